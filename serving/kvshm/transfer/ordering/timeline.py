"""Where a handler's jobs run, one after another: the ordering half of the handler contract.

A Timeline runs each launched job after the previous one finished, timing it from start to
end. CpuTimeline runs jobs on one worker thread (the CPU backend's "stream"); CudaTimeline
(kvshm.transfer.ordering.cuda_timeline) issues them in the caller's thread onto one CUDA stream.
"""

from __future__ import annotations

import queue
import threading
import time
from abc import ABC, abstractmethod

from kvshm.transfer.jobs.work import Lease, Stream, Work


class Ticket(ABC):
    """One launched job."""

    error: BaseException | None = None
    """Set, before the ticket reads as done, if the job's work raised."""

    @abstractmethod
    def done(self) -> bool: ...

    @abstractmethod
    def synchronize(self) -> None: ...

    @abstractmethod
    def seconds(self) -> float:
        """Start to end of the job's copies; only once done()."""


class Timeline(ABC):
    @abstractmethod
    def launch(self, work: Work, after: Stream | None) -> Ticket:
        """Run work after every job launched before it and, given the caller's compute
        stream as `after`, after the work already queued on it."""

    @abstractmethod
    def caller_stream(self) -> Stream | None:
        """The caller's current stream, for a job to follow the work queued on it (None where
        there is no such thing)."""

    @abstractmethod
    def release(self, ticket: Ticket) -> None:
        """Give a done ticket's resources back for reuse."""

    @abstractmethod
    def close(self) -> None:
        """Wait for every job and release what the timeline holds."""


class CpuTicket(Ticket):
    def __init__(self, work: Work) -> None:
        self.work: Work | None = work
        self.finished = threading.Event()
        self.elapsed = 0.0

    def done(self) -> bool:
        return self.finished.is_set()

    def synchronize(self) -> None:
        self.finished.wait()

    def seconds(self) -> float:
        return self.elapsed


class CpuTimeline(Timeline):
    """Jobs run in launch order on one daemon thread; there is no compute stream to wait for."""

    def __init__(self, name: str = "kvshm-transfer") -> None:
        self._queue: queue.SimpleQueue[CpuTicket | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def launch(self, work: Work, after: Stream | None) -> Ticket:
        ticket = CpuTicket(work)
        self._queue.put(ticket)
        return ticket

    def _run(self) -> None:
        while (ticket := self._queue.get()) is not None:
            started = time.perf_counter()
            try:
                assert ticket.work is not None
                kept = ticket.work(None)
                if isinstance(kept, Lease):  # the copies are done when work returns
                    kept.release()
            except Exception as exc:  # reported as the job's failure, never lost
                ticket.error = exc
            ticket.elapsed = time.perf_counter() - started
            ticket.work = None
            ticket.finished.set()

    def caller_stream(self) -> None:
        return None

    def release(self, ticket: Ticket) -> None:
        pass

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
