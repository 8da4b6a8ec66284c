"""Listening for the agent's drain event on the region's kvshm.ipc queue (docs/agent.md)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvshm.ipc import IpcError, MessageQueue, WaitCancelled, WaitPolicy, WriterDiedError

log = logging.getLogger(__name__)

EVENTS_RING = "kvshm_events"  # the agent's name (kvshm.agent.notify), in the region directory
ATTACH_TIMEOUT_S = 1.0
# a serving engine's thread: never spin holding the GIL
_WAITS = WaitPolicy(spin_seconds=0.0, max_sleep_seconds=0.05)


@dataclass(frozen=True)
class Drain:
    region: str
    instance_id: str
    reason: str
    deadline: float
    """Unix time after which the agent removes the file even if it is still held."""

    @classmethod
    def from_message(cls, message: Any) -> Drain | None:
        if not isinstance(message, dict) or message.get("type") != "drain":
            return None
        try:
            return cls(
                str(message["region"]),
                str(message["instanceId"]),
                str(message.get("reason", "")),
                float(message["deadline"]),
            )
        except (KeyError, TypeError, ValueError):
            return None


class DrainListener:
    """Joins the region's event queue as a reader and calls on_drain(event) once, from its own
    thread, when a drain for instance_id arrives. Without a queue (no agent events) it logs and
    does nothing: the agent's holder probe and grace period still decide removal."""

    def __init__(self, directory: str, instance_id: str, on_drain: Callable[[Drain], None]) -> None:
        self._instance_id = instance_id
        self._on_drain = on_drain
        self._stop = threading.Event()
        self._queue: MessageQueue | None = None
        path = os.path.join(directory, EVENTS_RING)
        try:
            self._queue = MessageQueue.attach(
                path, wait_policy=_WAITS, attach_timeout=ATTACH_TIMEOUT_S
            )
        except (IpcError, OSError, ValueError) as exc:
            log.warning("kvshm: no drain events for %s (%s): %s", instance_id, path, exc)
            self._thread: threading.Thread | None = None
            return
        self._thread = threading.Thread(target=self._run, name="kvshm-drain", daemon=True)
        self._thread.start()

    @property
    def listening(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        assert self._queue is not None
        while not self._stop.is_set():
            try:
                message = self._queue.dequeue(cancel=self._stop, indefinite=True)
            except WaitCancelled:
                return
            except WriterDiedError:
                time.sleep(1.0)  # a restarted agent resumes writing to the same ring
                continue
            except (IpcError, OSError, ValueError) as exc:
                log.warning("kvshm: drain events for %s stopped: %s", self._instance_id, exc)
                return
            event = Drain.from_message(message)
            if event is not None and event.instance_id == self._instance_id:
                self._on_drain(event)
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        if self._queue is not None:
            try:
                self._queue.close()
            except (IpcError, OSError) as exc:
                log.warning("kvshm: closing the drain event queue: %s", exc)
            self._queue = None
