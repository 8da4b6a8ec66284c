"""The metrics/health endpoint against idle, slow and flooding connections."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry

from kvshm.agent.server import Health, agent_routes
from kvshm.endpoints import REQUEST_TIMEOUT_SECONDS, BoundedHttpServer
from tests.agent.hostile import RunningAgent, tenant_manifest, tenant_process, write_regions
from tests.waiting import wait_for

_IDLE_CONNECTIONS = """
import socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = [socket.create_connection((host, port), timeout=10) for _ in range(count)]
print("holding", len(held), flush=True)
time.sleep(120)
"""

FLOOD_SECONDS = 5.0
# as many connects from one source address as one process makes for at most a few seconds, none
# sending anything; the newest 400 ends stay open (more than the server's cap, so it must close
# some to take more)
_SILENT_FLOOD = """
import collections, socket, sys, time
source, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
seconds, most = float(sys.argv[4]), int(sys.argv[5])
held = collections.deque()
made = 0
print("flooding", flush=True)
deadline = time.monotonic() + seconds
while made < most and time.monotonic() < deadline:
    sock = socket.socket()
    sock.settimeout(1)
    try:
        sock.bind((source, 0))
        sock.connect((host, port))
    except OSError:
        sock.close()
        continue
    made += 1
    held.append(sock)
    if len(held) > 400:
        held.popleft().close()
print(made, flush=True)
"""

# a kubelet's probes (a process of their own), only more often: one answer or error a line
_PROBES = f"""
import sys, time, urllib.request
deadline = time.monotonic() + {FLOOD_SECONDS - 0.5}
while time.monotonic() < deadline:
    try:
        with urllib.request.urlopen(sys.argv[1], timeout=3) as reply:
            reply.read()
            print(reply.status, flush=True)
    except OSError as exc:
        print(repr(exc), flush=True)
    time.sleep(0.1)
"""


def _get(url: str, timeout: float = 3) -> tuple[int, float]:
    started = time.monotonic()
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        reply.read()
        return reply.status, time.monotonic() - started


def test_200_idle_connections_hold_no_threads_and_healthz_answers(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    write_regions(regions, "before.yaml", tenant_manifest("before"))
    # the setting: 128 descriptors, where 200 idle connections wedged every pass
    with RunningAgent(regions, shm_dir / "root", "--port", "0", nofile=128) as agent:
        agent.saw("tenant/before  Ready")
        baseline_threads = agent.threads()
        host, port = agent.url.removeprefix("http://").rsplit(":", 1)
        attacker = tenant_process(_IDLE_CONNECTIONS, host, port, "200")
        try:
            assert attacker.stdout is not None
            assert attacker.stdout.readline().startswith("holding 200")
            for _ in range(10):
                status, seconds = _get(agent.url + "/healthz")
                assert status == 200 and seconds < 2
            # no thread per connection, descriptors bounded by the connection cap
            assert agent.threads() <= baseline_threads + 1
            assert agent.descriptors() < 128
            # the agent still serves regions: a new one goes Ready while the attack goes on
            write_regions(regions, "after.yaml", tenant_manifest("after"))
            agent.saw("tenant/after  Ready")
            # idle connections are closed after the request timeout, though the attacker
            # still holds its ends open
            wait_for(lambda: agent.descriptors() < 40, 15, "idle connections closed")
            assert attacker.poll() is None
        finally:
            attacker.kill()
            attacker.wait()


@contextlib.contextmanager
def _endpoints(
    max_connections: int, request_timeout: float = REQUEST_TIMEOUT_SECONDS
) -> Iterator[BoundedHttpServer]:
    """The agent's routes, always live, on a server the test starts; stopped afterwards."""
    health = Health(stale_after_seconds=60)
    health.passed()
    routes = agent_routes(CollectorRegistry(), health)
    server = BoundedHttpServer(
        "127.0.0.1", 0, routes, max_connections=max_connections, request_timeout=request_timeout
    )
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_a_slow_request_is_cut_off_and_the_oldest_idle_connection_makes_room() -> None:
    with _endpoints(max_connections=4, request_timeout=0.5) as server:
        server.start()
        address = ("127.0.0.1", server.server_port)
        slow = socket.create_connection(address)
        slow.sendall(b"GET /heal")  # never finishes its request line
        started = time.monotonic()
        slow.settimeout(5)
        answer = slow.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 2
        idle = [socket.create_connection(address) for _ in range(4)]
        wait_for(lambda: server.connections == 4, 5, "four idle connections accepted")
        status, _ = _get(f"http://127.0.0.1:{server.server_port}/healthz")
        assert status == 200 and server.evicted >= 1
        idle[0].settimeout(5)
        assert idle[0].recv(1) == b""  # the oldest was closed to make room
        oversized = socket.create_connection(address)
        oversized.sendall(b"GET /" + b"x" * 9000)
        oversized.settimeout(5)
        assert oversized.recv(4096).startswith(b"HTTP/1.1 431")
        for each in (slow, oversized, *idle):
            each.close()


def test_every_probe_made_through_a_flood_of_silent_connects_is_answered() -> None:
    # a small cap: this machine's connect rate then stands for a faster flood of a larger cap
    with _endpoints(max_connections=4) as server:
        server.start()
        port = str(server.server_port)
        # the flood comes from a tenant's address, the probes from the node's (as a kubelet's)
        flood = tenant_process(
            _SILENT_FLOOD, "127.0.0.2", "127.0.0.1", port, str(FLOOD_SECONDS), "100000"
        )
        try:
            assert flood.stdout is not None and flood.stdout.readline() == "flooding\n"
            probes = subprocess.run(
                [sys.executable, "-I", "-c", _PROBES, f"http://127.0.0.1:{port}/healthz"],
                capture_output=True,
                text=True,
                timeout=FLOOD_SECONDS + 30,
            ).stdout.splitlines()
            assert flood.wait(FLOOD_SECONDS + 10) == 0
            connects = int(flood.stdout.read())
            failures = [answer for answer in probes if answer != "200"]
            print(
                f"{connects} connects, {server.evicted} closed to make room; "
                f"{len(failures)} of {len(probes)} probes failed: {failures}"
            )
            assert len(probes) >= 20 and server.evicted >= 1000  # the flood did fill the server
            assert not failures, f"{len(failures)} of {len(probes)} probes failed: {failures}"
        finally:
            flood.kill()
            flood.wait()


def test_a_request_already_in_is_answered_before_a_connection_is_closed_to_make_room() -> None:
    with _endpoints(max_connections=4) as server:
        address = ("127.0.0.1", server.server_port)
        # all of them wait in the listen queue, the probe's request in, before the server starts
        earlier = [socket.create_connection(address) for _ in range(4)]
        probe = socket.create_connection(address)
        probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: agent\r\n\r\n")
        later = [socket.create_connection(address) for _ in range(8)]
        server.start()
        try:
            probe.settimeout(5)
            assert probe.recv(4096).startswith(b"HTTP/1.1 200")
            wait_for(lambda: server.evicted >= 8, 5, "silent connections closed to make room")
        finally:
            for each in (*earlier, probe, *later):
                each.close()
