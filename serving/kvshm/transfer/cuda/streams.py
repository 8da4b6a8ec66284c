"""CUDA streams of kvshm's own, outside torch's stream pool.

torch.cuda.Stream() creates no stream: it hands out one of 32 per device and priority, in
turn. A process that asks for more (a serving engine's streams, its offloading handlers, a
benchmark's) is given the same stream twice, and two unrelated queues become one: on an H100
host a handler's store stream, drawn 32 requests after the stream the matrix products ran on,
was that stream, so the stores waited for every queued product (docs/transfer.md).
kvshm's copy streams come from the driver instead. Like
torch's, they live as long as the process: destroyed with their last reference (at exit,
too), two test processes died of SIGSEGV, which they do not when kept. A shut-down handler
gives its streams back for the next one.
"""

from __future__ import annotations

import threading

import torch

from kvshm.transfer.cuda.driver import cuda_driver

_free: dict[int, list[int]] = {}  # per device index, streams given back
_lock = threading.Lock()


def own_stream(device: torch.device) -> torch.cuda.ExternalStream:
    """A non-blocking stream on `device` that no torch.cuda.Stream() can be given: one given
    back earlier, else a new one, created in the device's primary context (made current on a
    thread that has none, as torch's own first CUDA call there would)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _lock:
        free = _free.get(index)
        handle = free.pop() if free else None
    if handle is None:
        driver = cuda_driver()
        with torch.cuda.device(index):
            # torch switches devices only when the index differs, so a thread the process
            # started (device 0, no context) still has none here
            if not driver.has_current_context():
                torch.cuda.set_device(index)
            handle = driver.create_stream()
    return torch.cuda.ExternalStream(handle, device=torch.device("cuda", index))


def give_back(stream: torch.cuda.Stream) -> None:
    """Return a stream from own_stream for reuse; its owner must not use it again (work still
    queued on it runs first, in order, before the next owner's)."""
    with _lock:
        _free.setdefault(stream.device.index, []).append(stream.cuda_stream)
