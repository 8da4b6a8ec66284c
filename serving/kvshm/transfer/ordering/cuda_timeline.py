"""CudaTimeline: a handler's jobs, issued by the caller, in order on CUDA streams.

By default all jobs of a handler share one stream, which keeps them in submission order by
stream semantics alone. stream_per_job is vLLM's scheme: each job on a pooled stream that
waits for the previous job's end event. The observable contract (in-order completion,
timing, waits) is the same; bench/transfer compares the two.

Copies are issued in the caller's thread, inside transfer_async. Issuing from a worker thread
lost end to end: between driver calls the worker needs the GIL, which the caller holds while
it plans the next jobs (docs/transfer.md).
"""

from __future__ import annotations

import torch

from kvshm.transfer.cuda.streams import give_back, own_stream
from kvshm.transfer.jobs.work import Lease, Stream, Work
from kvshm.transfer.ordering.timeline import Ticket, Timeline


class CudaTicket(Ticket):
    def __init__(
        self, stream: torch.cuda.Stream, start: torch.cuda.Event, end: torch.cuda.Event
    ) -> None:
        self.stream = stream
        self.start = start
        self.end = end
        self.keep: object = None

    def done(self) -> bool:
        return bool(self.end.query())

    def synchronize(self) -> None:
        self.end.synchronize()

    def seconds(self) -> float:
        return float(self.start.elapsed_time(self.end)) / 1000.0


CALLERS_KEPT = 64


class CudaTimeline(Timeline):
    def __init__(self, device: torch.device, stream_per_job: bool = False) -> None:
        self._device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._stream_per_job = stream_per_job
        self._streams: list[torch.cuda.Stream] = []
        if not stream_per_job:
            self._streams.append(own_stream(device))
        self._events: list[torch.cuda.Event] = []
        self._last_end: torch.cuda.Event | None = None
        # marks the caller's compute for the next job to wait on; one event serves every job,
        # since a wait takes the event's state when it is issued
        self._compute_done = torch.cuda.Event()
        self._callers: dict[int, torch.cuda.Stream] = {}  # per raw handle, at most CALLERS_KEPT

    def caller_stream(self) -> torch.cuda.Stream:
        # torch.cuda.current_stream builds a new Stream object per call, the raw handle is
        # cheap and names the same stream (docs/transfer.md): one object is kept per
        # handle (a process uses a few streams)
        stream = self._callers.get(torch._C._cuda_getCurrentRawStream(self._index))
        if stream is None:
            stream = torch.cuda.current_stream(self._device)
            if len(self._callers) < CALLERS_KEPT:
                self._callers[stream.cuda_stream] = stream
        return stream

    def _event(self) -> torch.cuda.Event:
        return self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)

    def _stream(self) -> torch.cuda.Stream:
        if not self._stream_per_job:
            return self._streams[0]
        return self._streams.pop() if self._streams else own_stream(self._device)

    def launch(self, work: Work, after: Stream | None) -> Ticket:
        # the backends issue on the streams they are given, but driver calls go to the
        # current device's context
        if torch.cuda.current_device() == self._index:
            return self._launch(work, after)
        with torch.cuda.device(self._index):
            return self._launch(work, after)

    def _launch(self, work: Work, after: Stream | None) -> Ticket:
        stream = self._stream()
        if after is not None:
            self._compute_done.record(after)
            stream.wait_event(self._compute_done)
        if self._stream_per_job and self._last_end is not None:
            stream.wait_event(self._last_end)
        ticket = CudaTicket(stream, self._event(), self._event())
        ticket.start.record(stream)
        try:
            ticket.keep = work(stream)
        except Exception as exc:
            # copies issued before the error still run: the end event follows them, so the
            # next job cannot overtake them; the job is reported as failed
            ticket.error = exc
        ticket.end.record(stream)
        self._last_end = ticket.end
        return ticket

    def release(self, ticket: Ticket) -> None:
        assert isinstance(ticket, CudaTicket)
        if self._last_end is ticket.end:
            self._last_end = None  # done: nothing left to wait for
        if isinstance(ticket.keep, Lease):
            ticket.keep.release()
        ticket.keep = None
        if self._stream_per_job:
            self._streams.append(ticket.stream)
        self._events += [ticket.start, ticket.end]

    def close(self) -> None:
        if self._last_end is not None:
            self._last_end.synchronize()  # the last job ends after every earlier one
        self._last_end = None
        self._events.clear()
        for stream in self._streams:
            give_back(stream)
        self._streams.clear()
