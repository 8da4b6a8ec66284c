"""Listening for the agent's drain event on the region's kvshm.ipc queue (docs/agent.md)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from kvshm.ipc import (
    IpcError,
    MessageQueue,
    ReaderEvictedError,
    WaitCancelled,
    WaitPolicy,
    WriterDiedError,
)
from kvshm.region.drain_event import EVENTS_RING, DrainEvent

log = logging.getLogger(__name__)

ATTACH_TIMEOUT_S = 0.5  # one try, in the listener's thread
ATTACH_RETRY_S = 5.0
# drain events are dicts of a few hundred bytes: a reader takes no more from a ring the tenant
# can write (a scribbled length would otherwise make every worker hold up to a terabyte)
DRAIN_EVENT_MAX_BYTES = 64 << 10
# failures without a message in between: more is not one damaged message but a broken reader
_FAILURES_BEFORE_REJOIN = 3
# a serving engine's thread: never spin holding the GIL
_WAITS = WaitPolicy(spin_seconds=0.0, max_sleep_seconds=0.05)


class DrainListener:
    """Joins the region's event queue as a reader and calls on_drain(event) once, from its own
    thread, when a drain for instance_id arrives.

    Joining happens in that thread too, so building a worker never waits for the queue: without
    one (an agent that has not made it yet, or none) it logs once and tries again every
    retry_s until it joins or is closed; meanwhile the agent's holder probe and grace period
    still decide removal. A drain sent before the listener joined is not seen.

    The tenant can write the ring, so anything may come out of it. A damaged or oversized
    message is logged and stepped over; a listener the writer evicted, or whose ring fails
    _FAILURES_BEFORE_REJOIN times in a row, leaves and joins afresh after retry_s (drains sent
    in between are not seen). The thread ends only with the drain or close().
    """

    def __init__(
        self,
        directory: str,
        instance_id: str,
        on_drain: Callable[[DrainEvent], None],
        *,
        retry_s: float = ATTACH_RETRY_S,
    ) -> None:
        self._path = os.path.join(directory, EVENTS_RING)
        self._instance_id = instance_id
        self._on_drain = on_drain
        self._retry_s = retry_s
        self._stop = threading.Event()
        # guards _queue (closed once, by close() or by the thread), _joined and _ended
        self._state = threading.Condition()
        self._queue: MessageQueue | None = None
        self._joined = False
        self._ended = False
        self._thread = threading.Thread(target=self._run, name="kvshm-drain", daemon=True)
        self._thread.start()

    @property
    def listening(self) -> bool:
        """Whether the listener is joined to the event queue now: not before it has joined,
        while it joins again, nor once it has stopped (closed, or its drain arrived)."""
        with self._state:
            return self._joined and not self._stop.is_set()

    def wait_listening(self, timeout: float) -> bool:
        """Wait until the listener has joined (True), or it stopped or timeout passed (False)."""
        with self._state:
            self._state.wait_for(lambda: self._joined or self._ended, timeout)
        return self.listening

    def _run(self) -> None:
        try:
            while True:
                queue = self._join()
                if queue is None:
                    return
                try:
                    done = self._follow(queue)
                finally:
                    self._leave(queue)  # a reader that stops reading leaves: no one waits for it
                if done:
                    return
                log.info("kvshm: joining the drain events for %s again", self._instance_id)
                if self._stop.wait(self._retry_s):
                    return
        finally:
            with self._state:
                self._joined = False
                self._ended = True
                self._state.notify_all()

    def _join(self) -> MessageQueue | None:
        warned = False
        while not self._stop.is_set():
            try:
                queue = MessageQueue.attach(
                    self._path,
                    wait_policy=_WAITS,
                    attach_timeout=ATTACH_TIMEOUT_S,
                    max_message_bytes=DRAIN_EVENT_MAX_BYTES,
                )
            except Exception as exc:  # whatever is at the path, the listener tries again
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
            with self._state:
                if self._stop.is_set():  # closed while joining
                    _close_quietly(queue)
                    return None
                self._queue = queue
                self._joined = True
                self._state.notify_all()
            if warned:
                log.info("kvshm: listening for drain events for %s", self._instance_id)
            return queue
        return None

    def _follow(self, queue: MessageQueue) -> bool:
        """Read events until the drain arrived or the listener was closed (True), or until
        this reader must join again (False)."""
        failures = 0
        while not self._stop.is_set():
            try:
                message = queue.dequeue(cancel=self._stop, indefinite=True)
            except WaitCancelled:
                return True
            except WriterDiedError:
                self._stop.wait(1.0)  # a restarted agent resumes writing to the same ring
                continue
            except ReaderEvictedError as exc:
                log.warning("kvshm: drain events for %s: %s", self._instance_id, exc)
                return False
            except Exception as exc:  # the tenant can write the ring: never end the thread
                failures += 1
                log.warning(
                    "kvshm: drain events for %s: stepped over damage in the ring (%s: %s)",
                    self._instance_id,
                    type(exc).__name__,
                    exc,
                )
                if failures >= _FAILURES_BEFORE_REJOIN:
                    return False
                continue
            failures = 0
            event = DrainEvent.from_message(message)
            if event is not None and event.instance_id == self._instance_id:
                self._on_drain(event)
                return True
        return True

    def _leave(self, queue: MessageQueue) -> None:
        with self._state:
            mine = self._queue is queue  # else close() has taken it to close
            if mine:
                self._queue = None
            self._joined = False
        if mine:
            _close_quietly(queue)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        with self._state:
            queue, self._queue = self._queue, None
        if queue is not None:
            _close_quietly(queue)


def _close_quietly(queue: MessageQueue) -> None:
    try:
        queue.close()
    except (IpcError, OSError) as exc:
        log.warning("kvshm: closing the drain event queue: %s", exc)
