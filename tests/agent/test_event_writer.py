"""The agent's drain events are written by a child process: a ring a tenant truncated can kill
that child (SIGBUS), never the agent, and the other regions keep a live writer."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import yaml

from kvshm.agent.app import build_app
from kvshm.agent.cli import parse_config
from kvshm.agent.drain.eventwriter import IsolatedEventQueues
from kvshm.agent.reconciler import NodeReconciler, ReconcilerSettings
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.root.saferoot import RegionRoot
from kvshm.api import NodeRegionPhase
from kvshm.ipc import MessageQueue
from kvshm.region.drain_event import EVENTS_RING
from tests.agent.builders import manifest, region, settle, view
from tests.waiting import wait_for


def test_a_writer_killed_by_sigbus_is_replaced_and_events_still_arrive(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = shm_dir / "root"
    notifier = IsolatedEventQueues()
    agent = NodeReconciler(
        RegionRoot(str(root)), notifier, ReconcilerSettings(), holds=HoldChecker()
    )
    r1, r2 = region("r1"), region("r2")
    workers: dict[str, MessageQueue] = {}
    try:
        settle(agent, view(r1, r2))
        first = notifier.writer_pid
        assert first is not None and first != os.getpid()
        # the agent itself never maps a ring, so a truncated one cannot fault in it
        assert EVENTS_RING not in Path("/proc/self/maps").read_text()
        for name in ("r1", "r2"):
            workers[name] = MessageQueue.attach(str(root / "ns1" / name / EVENTS_RING))

        os.kill(first, signal.SIGBUS)  # what touching a truncated ring's mapping does
        # the watchdog starts another at once, which takes over both rings
        wait_for(lambda: notifier.writer_pid not in (None, first), 10, "a new writer")
        assert notifier.writer_running()

        result = settle(agent, view(r2))  # r1 deleted: its drain event needs a writer again
        assert result.reports["ns1/r1"].phase is NodeRegionPhase.REMOVED
        event = workers["r1"].dequeue(timeout=10)
        assert event["type"] == "drain" and event["region"] == "ns1/r1"
        assert "the event writer exited (code -7)" in caplog.text  # -SIGBUS

        settle(agent, view())  # r2's ring was resumed by the new writer too
        assert workers["r2"].dequeue(timeout=10)["region"] == "ns1/r2"
    finally:
        for worker in workers.values():
            worker.close()
        notifier.shutdown()


def test_an_agent_that_stops_stops_its_event_writer(shm_dir: Path) -> None:
    """The writer child goes with the agent's run (its rings stay for the next start), so an
    agent run in-process (`--once`, the tests' agents) leaves no process behind."""
    regions = shm_dir / "regions"
    regions.mkdir()
    (regions / "r.yaml").write_text(yaml.safe_dump(manifest("r", blocks=4, page=4096, workers=1)))
    root = shm_dir / "root"
    app = build_app(parse_config(["--local", str(regions), "--root", str(root), "--once",
                                  "--no-http"]))  # fmt: skip
    assert app.run(threading.Event()) == 0
    assert (root / "ns1" / "r" / EVENTS_RING).is_file()  # a writer made the ring
    assert app.events.writer_pid is None and not app.events.writer_running()
    app.root.close()
