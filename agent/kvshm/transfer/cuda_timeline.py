"""CudaTimeline: a handler's jobs, issued by the caller, on one CUDA stream.

One stream keeps jobs in submission order by stream semantics alone. vLLM instead puts each
job on a pooled stream that waits for the previous job's end event; on an H200 that chain
measured 2-3 GB/s slower at 256 KiB blocks than one stream (bench/transfer/explore.py), and
the observable contract (in-order completion, timing, waits) is the same.

Copies are issued in the caller's thread, inside transfer_async. Issuing from a worker thread
was measured too and lost 5-10 % end to end: between driver calls the worker needs the GIL,
which the caller holds while it plans the next jobs (docs/transfer.md).
"""

from __future__ import annotations

import torch

from kvshm.transfer.timeline import Ticket, Timeline, Work


class CudaTicket(Ticket):
    def __init__(self, start: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.start = start
        self.end = end
        self.keep: object = None

    def done(self) -> bool:
        return bool(self.end.query())

    def synchronize(self) -> None:
        self.end.synchronize()

    def seconds(self) -> float:
        return float(self.start.elapsed_time(self.end)) / 1000.0


class CudaTimeline(Timeline):
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._stream = torch.cuda.Stream(device)
        self._events: list[torch.cuda.Event] = []

    def _event(self) -> torch.cuda.Event:
        return self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)

    def launch(self, work: Work, after_compute: bool) -> Ticket:
        stream = self._stream
        with torch.cuda.device(self._device):
            if after_compute:
                stream.wait_stream(torch.cuda.current_stream(self._device))
            ticket = CudaTicket(self._event(), self._event())
            ticket.start.record(stream)
            try:
                with torch.cuda.stream(stream):
                    ticket.keep = work(stream)
            except Exception as exc:
                # copies issued before the error still run: the end event follows them, so
                # the next job cannot overtake them; the job is reported as failed
                ticket.error = exc
            ticket.end.record(stream)
        return ticket

    def release(self, ticket: Ticket) -> None:
        assert isinstance(ticket, CudaTicket)
        ticket.keep = None
        self._events += [ticket.start, ticket.end]

    def close(self) -> None:
        self._stream.synchronize()
        self._events.clear()
