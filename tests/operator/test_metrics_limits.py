"""The operator's /metrics against idle half-requests from whoever reaches its port: no thread
per connection, descriptors bounded by the connection cap, and a scrape still answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshm.endpoints import MAX_CONNECTIONS, REQUEST_TIMEOUT_SECONDS
from tests.envtest.server import free_port
from tests.source_roots import pythonpath
from tests.waiting import wait_for

IDLE_HALF_REQUESTS = 300

# what the operator runs at start (handlers.startup), alone in a process of its own
_OPERATOR_METRICS = """
import sys, time
from kvshm.operator import metrics
metrics.serve_once(int(sys.argv[1]), "127.0.0.1")
print("serving", flush=True)
time.sleep(600)
"""


def _status_field(pid: int, name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split(":", 1)[1])
    raise AssertionError(f"/proc/{pid}/status has no {name}")


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def operator_metrics() -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-c", _OPERATOR_METRICS, str(port)],
        env={**os.environ, "PYTHONPATH": pythonpath()},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None and process.stdout.readline() == "serving\n"
        yield process, port
    finally:
        process.kill()
        process.wait()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.status == 200
        return str(reply.read().decode())


def test_300_idle_half_requests_hold_no_threads_and_a_scrape_answers(
    operator_metrics: tuple[subprocess.Popen[str], int],
) -> None:
    process, port = operator_metrics
    assert "kvshm_operator_reconciles_total" in _scrape(port)
    threads_before = _status_field(process.pid, "Threads")
    descriptors_before = _descriptors(process.pid)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(IDLE_HALF_REQUESTS)]
    try:
        for sock in held:  # a request line and a header, never the blank line that ends it
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: operator\r\n")
        # answered behind every half-request the server has taken in
        assert "kvshm_operator_regions" in _scrape(port)
        threads_under_attack = _status_field(process.pid, "Threads")
        print(f"threads: {threads_before} before, {threads_under_attack} under attack")
        assert threads_under_attack <= threads_before + 1, (
            f"{threads_under_attack} threads under {IDLE_HALF_REQUESTS} idle half-requests "
            f"({threads_before} before)"
        )
        assert _descriptors(process.pid) <= descriptors_before + MAX_CONNECTIONS + 1
        # idle connections are closed after the request timeout, though their ends stay open
        wait_for(
            lambda: _descriptors(process.pid) <= descriptors_before,
            REQUEST_TIMEOUT_SECONDS + 10,
            "idle half-requests closed",
        )
        assert "kvshm_operator_regions" in _scrape(port)
    finally:
        for sock in held:
            sock.close()
