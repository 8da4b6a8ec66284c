"""The agent's drain events are written by a child process: a ring a tenant truncated can kill
that child (SIGBUS), never the agent, and the other regions keep a live writer."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kvshm.agent.eventwriter import IsolatedEventQueues
from kvshm.agent.holders import HoldChecker
from kvshm.agent.notify import EVENTS_RING
from kvshm.agent.reconciler import NodeReconciler, ReconcilerSettings
from kvshm.agent.saferoot import RegionRoot
from kvshm.api import NodeRegionPhase
from kvshm.ipc import MessageQueue
from tests.agent.builders import region, settle, view
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
