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
ATTACH_TIMEOUT_S = 0.5  # one try, in the listener's thread
ATTACH_RETRY_S = 5.0
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
    thread, when a drain for instance_id arrives.

    Joining happens in that thread too, so building a worker never waits for the queue: without
    one (an agent that has not made it yet, or none) it logs once and tries again every
    retry_s until it joins or is closed; meanwhile the agent's holder probe and grace period
    still decide removal. A drain sent before the listener joined is not seen.
    """

    def __init__(
        self,
        directory: str,
        instance_id: str,
        on_drain: Callable[[Drain], None],
        *,
        retry_s: float = ATTACH_RETRY_S,
    ) -> None:
        self._path = os.path.join(directory, EVENTS_RING)
        self._instance_id = instance_id
        self._on_drain = on_drain
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._joined = threading.Event()
        self._lock = threading.Lock()  # the queue is closed once, by close() or by the thread
        self._queue: MessageQueue | None = None
        self._thread = threading.Thread(target=self._run, name="kvshm-drain", daemon=True)
        self._thread.start()

    @property
    def listening(self) -> bool:
        """Whether the listener has joined the event queue and not stopped."""
        return self._joined.is_set() and not self._stop.is_set()

    def wait_listening(self, timeout: float) -> bool:
        return self._joined.wait(timeout) and not self._stop.is_set()

    def _join(self) -> MessageQueue | None:
        warned = False
        while not self._stop.is_set():
            try:
                queue = MessageQueue.attach(
                    self._path, wait_policy=_WAITS, attach_timeout=ATTACH_TIMEOUT_S
                )
            except (IpcError, OSError, ValueError) as exc:
                if not warned:
                    log.warning(
                        "kvshm: no drain events for %s yet (%s): %s; trying again every %.0f s",
                        self._instance_id,
                        self._path,
                        exc,
                        self._retry_s,
                    )
                    warned = True
                self._stop.wait(self._retry_s)
                continue
            with self._lock:
                if self._stop.is_set():  # closed while joining
                    _close_quietly(queue)
                    return None
                self._queue = queue
            if warned:
                log.info("kvshm: listening for drain events for %s", self._instance_id)
            self._joined.set()
            return queue
        return None

    def _run(self) -> None:
        queue = self._join()
        if queue is None:
            return
        while not self._stop.is_set():
            try:
                message = queue.dequeue(cancel=self._stop, indefinite=True)
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
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        with self._lock:
            queue, self._queue = self._queue, None
        if queue is not None:
            _close_quietly(queue)


def _close_quietly(queue: MessageQueue) -> None:
    try:
        queue.close()
    except (IpcError, OSError) as exc:
        log.warning("kvshm: closing the drain event queue: %s", exc)
