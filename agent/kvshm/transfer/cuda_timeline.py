"""CudaTimeline: jobs on pooled CUDA streams, each waiting for the previous job's end event."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvshm.transfer.timeline import Ticket, Timeline, Work


@dataclass
class CudaTicket(Ticket):
    stream: torch.cuda.Stream
    start: torch.cuda.Event
    end: torch.cuda.Event
    keep: object = None
    error: BaseException | None = field(default=None)

    def done(self) -> bool:
        return bool(self.end.query())

    def synchronize(self) -> None:
        self.end.synchronize()

    def seconds(self) -> float:
        return float(self.start.elapsed_time(self.end)) / 1000.0


class CudaTimeline(Timeline):
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._streams: list[torch.cuda.Stream] = []
        self._events: list[torch.cuda.Event] = []
        self._last_end: torch.cuda.Event | None = None

    def _event(self) -> torch.cuda.Event:
        return self._events.pop() if self._events else torch.cuda.Event(enable_timing=True)

    def launch(self, work: Work, after_compute: bool) -> Ticket:
        with torch.cuda.device(self._device):
            stream = self._streams.pop() if self._streams else torch.cuda.Stream(self._device)
            ticket = CudaTicket(stream, self._event(), self._event())
            if after_compute:
                stream.wait_stream(torch.cuda.current_stream(self._device))
            if self._last_end is not None:
                stream.wait_event(self._last_end)
            ticket.start.record(stream)
            try:
                with torch.cuda.stream(stream):
                    ticket.keep = work(stream)
            except Exception as exc:
                # copies issued before the error still run: keep the job in the chain so the
                # next job cannot overtake them
                ticket.error = exc
            ticket.end.record(stream)
            self._last_end = ticket.end
        return ticket

    def release(self, ticket: Ticket) -> None:
        assert isinstance(ticket, CudaTicket)
        if self._last_end is ticket.end:
            self._last_end = None
        ticket.keep = None
        self._streams.append(ticket.stream)
        self._events += [ticket.start, ticket.end]

    def close(self) -> None:
        if self._last_end is not None:
            self._last_end.synchronize()
        self._last_end = None
        self._streams.clear()
        self._events.clear()
