"""CudaTimeline: a handler's jobs on one CUDA stream, issued by one worker thread.

One stream keeps jobs in submission order by stream semantics alone. vLLM instead puts each
job on a pooled stream that waits for the previous job's end event; on an H200 that chain
measured 2-3 GB/s slower at 256 KiB blocks than one stream (bench/transfer/explore.py), and
the observable contract (in-order completion, timing, waits) is the same.

The worker thread does the issuing, so transfer_async returns after the pointer math instead
of after thousands of driver calls, and the two directions issue in parallel (the driver
releases the GIL). A GPU->CPU job still waits for exactly the compute work queued when it was
submitted: an event recorded on the caller's stream at that moment.
"""

from __future__ import annotations

import queue
import threading

import torch

from kvshm.transfer.timeline import Ticket, Timeline, Work


class CudaTicket(Ticket):
    def __init__(
        self,
        work: Work,
        start: torch.cuda.Event,
        end: torch.cuda.Event,
        ready: torch.cuda.Event | None,
    ) -> None:
        self.work: Work | None = work
        self.start = start
        self.end = end
        self.ready = ready
        self.keep: object = None
        self.issued = threading.Event()

    def done(self) -> bool:
        # an event that was never recorded reads as complete: check it was issued first
        return self.issued.is_set() and bool(self.end.query())

    def synchronize(self) -> None:
        self.issued.wait()
        self.end.synchronize()

    def seconds(self) -> float:
        return float(self.start.elapsed_time(self.end)) / 1000.0


class CudaTimeline(Timeline):
    def __init__(self, device: torch.device, name: str = "kvshm-transfer-cuda") -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device)
        self._timing_events: list[torch.cuda.Event] = []
        self._ready_events: list[torch.cuda.Event] = []
        self._queue: queue.SimpleQueue[CudaTicket | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _timing_event(self) -> torch.cuda.Event:
        if self._timing_events:
            return self._timing_events.pop()
        return torch.cuda.Event(enable_timing=True)

    def launch(self, work: Work, after_compute: bool) -> Ticket:
        ready = None
        if after_compute:
            ready = self._ready_events.pop() if self._ready_events else torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._device))
        ticket = CudaTicket(work, self._timing_event(), self._timing_event(), ready)
        self._queue.put(ticket)
        return ticket

    def _run(self) -> None:
        torch.cuda.set_device(self._device)  # makes the device's context current here
        stream = self._stream
        while (ticket := self._queue.get()) is not None:
            if ticket.ready is not None:
                stream.wait_event(ticket.ready)
            ticket.start.record(stream)
            try:
                assert ticket.work is not None
                with torch.cuda.stream(stream):
                    ticket.keep = ticket.work(stream)
            except Exception as exc:
                # copies issued before the error still run: the end event still follows them,
                # so the next job cannot overtake them; the job is reported as failed
                ticket.error = exc
            ticket.end.record(stream)
            ticket.work = None
            ticket.issued.set()

    def release(self, ticket: Ticket) -> None:
        assert isinstance(ticket, CudaTicket)
        ticket.keep = None
        self._timing_events += [ticket.start, ticket.end]
        if ticket.ready is not None:
            self._ready_events.append(ticket.ready)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._stream.synchronize()
        self._timing_events.clear()
        self._ready_events.clear()
