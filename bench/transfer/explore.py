"""Experiments behind the backend choices (docs/transfer.md quotes them): how DMA issue cost
scales with issuing threads and copy attributes, how a job split between the copy kernel and
the copy engines performs, and whether ramping the first DMA chunks helps.

    PYTHONPATH=agent:operator python3 bench/transfer/explore.py
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from bench_transfer import (
    BURST_BYTES,
    KIB,
    Setup,
    gbps,
    handler_for,
    make_setup,
    median_seconds,
    specs_for,
    wall,
)

from kvshm.transfer.backends.cuda_driver import (
    CopyDirection,
    CUmemcpyAttributes,
    CUmemLocation,
    cuda_driver,
)
from kvshm.transfer.backends.kernel import KernelBackend
from kvshm.transfer.batch import CopyBatch

REPS = 5


def batches(setup: Setup, direction: str) -> list[CopyBatch]:
    handler = handler_for(setup, direction, backend="dma")
    out = [handler._planner.plan(spec) for spec in specs_for(setup, direction)]
    handler.shutdown()
    return out


def part(batch: CopyBatch, start: int, stop: int) -> CopyBatch:
    piece = CopyBatch.allocate(stop - start, pinned=True)
    piece.rows[:] = batch.rows[:, start:stop]
    return piece.with_total(int(piece.sizes.sum()))


def issue_dma(batch: CopyBatch, attrs: CUmemcpyAttributes, stream: int, per_call: Any) -> None:
    driver = cuda_driver()
    rows = batch.rows
    src, dst, sizes = rows[0].ctypes.data, rows[1].ctypes.data, rows[2].ctypes.data
    start = 0
    for count in per_call(batch.count):
        code = driver.memcpy_batch(
            dst + 8 * start, src + 8 * start, sizes + 8 * start, count, attrs, stream
        )
        driver.check("cuMemcpyBatchAsync", code)
        start += count


def fixed(size: int) -> Callable[[int], list[int]]:
    return lambda n: [min(size, n - s) for s in range(0, n, size)]


def ramp(n: int) -> list[int]:
    out, size, done = [], 8, 0
    while done < n:
        out.append(min(size, n - done))
        done += out[-1]
        size = min(size * 2, 128)
    return out


def attrs_for(
    direction: str, order: int | None = None, flags: int = 1, hints: bool = True
) -> CUmemcpyAttributes:
    base = CopyDirection(direction == "D2H", torch.cuda.current_device()).attributes()
    if order is not None:
        base.srcAccessOrder = order
    base.flags = flags
    if not hints:
        base.srcLocHint = CUmemLocation(0, 0)
        base.dstLocHint = CUmemLocation(0, 0)
    return base


def rate(setup: Setup, issue: Callable[[], None]) -> float:
    return gbps(setup.pass_bytes, median_seconds(lambda: wall(issue), REPS))


def threaded(setup: Setup, direction: str, threads: int) -> float:
    """Each job's descriptors split over `threads` threads, each on its own stream."""
    jobs = [
        [part(b, i * b.count // threads, (i + 1) * b.count // threads) for i in range(threads)]
        for b in batches(setup, direction)
    ]
    streams = [torch.cuda.Stream() for _ in range(threads)]
    attrs = attrs_for(direction)
    device = torch.cuda.current_device()

    def worker(i: int) -> None:
        torch.cuda.set_device(device)
        for pieces in jobs:
            issue_dma(pieces[i], attrs, streams[i].cuda_stream, fixed(128))

    def issue() -> None:
        pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()

    return rate(setup, issue)


def hybrid(setup: Setup, direction: str, kernel_share: float) -> float:
    """The first kernel_share of each job's copies by the kernel, the rest by DMA, at once."""
    kernel = KernelBackend(torch.device("cuda", torch.cuda.current_device()))
    jobs = []
    for b in batches(setup, direction):
        k = int(b.count * kernel_share)
        jobs.append((part(b, 0, k), part(b, k, b.count)))
    ks, ds = torch.cuda.Stream(), torch.cuda.Stream()
    attrs = attrs_for(direction)

    def issue() -> None:
        for on_kernel, on_dma in jobs:
            with torch.cuda.stream(ks):
                kernel.copy(on_kernel, ks)
            issue_dma(on_dma, attrs, ds.cuda_stream, fixed(128))

    return rate(setup, issue)


def hybrid_both(setup: Setup, kernel_share: float, threads: bool) -> float:
    kernel = KernelBackend(torch.device("cuda", torch.cuda.current_device()))
    half = len(setup.stores) // 2
    work = []
    for direction in ("D2H", "H2D"):
        all_batches = batches(setup, direction)
        chosen = all_batches[:half] if direction == "D2H" else all_batches[-half:]
        pieces = []
        for b in chosen:
            k = int(b.count * kernel_share)
            pieces.append((part(b, 0, k), part(b, k, b.count)))
        work.append(
            (direction, pieces, torch.cuda.Stream(), torch.cuda.Stream(), attrs_for(direction))
        )
    device = torch.cuda.current_device()

    def dma_side(i: int) -> None:
        torch.cuda.set_device(device)
        _, pieces, _, ds, attrs = work[i]
        for _, on_dma in pieces:
            issue_dma(on_dma, attrs, ds.cuda_stream, fixed(128))

    def issue() -> None:
        for _, pieces, ks, _, _ in work:
            for on_kernel, _ in pieces:
                with torch.cuda.stream(ks):
                    kernel.copy(on_kernel, ks)
        if threads:
            pool = [threading.Thread(target=dma_side, args=(i,)) for i in range(2)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        else:
            for i in range(2):
                dma_side(i)

    total = 2 * half * setup.pass_bytes // len(setup.stores)
    return gbps(total, median_seconds(lambda: wall(issue), REPS))


def single(setup: Setup, direction: str, per_call: Any, **attr_args: Any) -> tuple[float, float]:
    jobs = batches(setup, direction)
    attrs = attrs_for(direction, **attr_args)
    stream = torch.cuda.Stream()
    import time

    spent = []

    def issue() -> None:
        started = time.perf_counter()
        for b in jobs:
            issue_dma(b, attrs, stream.cuda_stream, per_call)
        spent.append(time.perf_counter() - started)

    r = rate(setup, issue)
    return r, float(np.median(spent)) / setup.copies_per_pass * 1e6


def main() -> None:
    print(f"device: {torch.cuda.get_device_name()}")
    rng = np.random.default_rng(1)
    for block in (16 * KIB, 64 * KIB, 256 * KIB):
        setup = make_setup(block, "/dev/shm", rng, pass_bytes=BURST_BYTES)
        try:
            b = f"{block // KIB}K"
            for direction in ("H2D", "D2H"):
                for threads in (1, 2, 4):
                    r = threaded(setup, direction, threads)
                    print(f"{b} {direction} dma threads={threads}: {r:.1f} GB/s")
                for name, args in [
                    ("default", {}),
                    ("flags=0", {"flags": 0}),
                    ("order=stream", {"order": 1}),
                    ("order=any", {"order": 3}),
                    ("no hints", {"hints": False}),
                ]:
                    try:
                        r, us = single(setup, direction, fixed(128), **args)
                        print(f"{b} {direction} dma attrs {name}: {r:.1f} GB/s, {us:.2f} us/desc")
                    except Exception as exc:
                        print(f"{b} {direction} dma attrs {name}: {exc}")
                r, us = single(setup, direction, ramp)
                print(f"{b} {direction} dma ramp: {r:.1f} GB/s, issue {us:.2f} us/desc")
                if block <= 64 * KIB:
                    for share in (0.5, 0.6, 0.7, 0.8):
                        r = hybrid(setup, direction, share)
                        print(f"{b} {direction} hybrid kernel={share}: {r:.1f} GB/s")
            if block <= 64 * KIB:
                for share in (0.0, 0.3, 0.5, 0.7):
                    for threads in (False, True):
                        r = hybrid_both(setup, share, threads)
                        print(f"{b} both hybrid kernel={share} dma-threads={threads}: {r:.1f} GB/s")
        finally:
            setup.close()


if __name__ == "__main__":
    main()
