"""The operator's writes give up on an API server that accepts a connection and never answers:
each call fails within its request timeout (a temporary error, retried by the caller) instead
of holding one of the writer's few threads for good."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshm.operator.kube import KubernetesClientWriter

KUBECONFIG = """apiVersion: v1
kind: Config
clusters: [{{name: silent, cluster: {{server: "http://127.0.0.1:{port}"}}}}]
users: [{{name: kvshm, user: {{token: t}}}}]
contexts: [{{name: silent, context: {{cluster: silent, user: kvshm}}}}]
current-context: silent
"""


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server that takes every connection and never writes a byte."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()


def test_every_write_gives_up_on_a_server_that_never_answers(
    silent_server: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text(KUBECONFIG.format(port=silent_server))
    monkeypatch.setenv("KUBECONFIG", str(config))
    writer = KubernetesClientWriter(request_timeout=(1.0, 0.5))
    calls = {
        "status": writer.patch_region_status("team", "r1", {"phase": "Ready"}),
        "json patch": writer.json_patch("offloadregions", "team", "r1", []),
        "spec edit": writer.edit_offload_node_spec("n1", lambda spec: {"reclaims": []}),
        "delete": writer.delete_offload_node("n1"),
    }
    for what, call in calls.items():
        started = time.monotonic()
        with pytest.raises(Exception, match=r"(?i)timed? ?out") as raised:
            asyncio.run(call)
        took = time.monotonic() - started
        assert took < 10, f"{what}: gave up after {took:.1f} s ({raised.value!r})"
