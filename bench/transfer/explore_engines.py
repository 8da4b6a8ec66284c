"""Round four: how fast the copy engines themselves run small descriptors, with the CPU's
issue cost taken out of the timing.

Every job's descriptors are queued behind a GPU sleep on the stream; the engines start when
the sleep ends, so events around the copies time the engines alone, provided the CPU
finished issuing before the sleep did (each line says how long issuing took, against the
sleep). Variants: 128 descriptors per call or one call per job, one stream or two streams
(do two streams reach two engines?), both directions queued at once, and one direction
split between the copy kernel and the engines.

    PYTHONPATH=agent:operator python3 bench/transfer/explore_engines.py [KiB ...] [part ...]

parts: engines, hybrid, load (issue cost while the link is busy), live (the split, live)
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from bench_transfer import BURST_BYTES, KIB, Setup, gbps, make_setup, median_seconds, wall
from explore import attrs_for, batches, fixed, issue_dma, part
from explore_limits import pinned

from kvshm.transfer.backends.kernel import KernelBackend
from kvshm.transfer.batch import CopyBatch

SLEEP_CYCLES = 400_000_000  # ~0.2 s on an H200: longer than issuing 16K descriptors
JOBS = 4  # 64 MiB each


def sleep_seconds() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def prequeued(
    queues: list[tuple[torch.cuda.Stream, Callable[[int], None]]],
    threads: bool = False,
    same_stream: bool = False,
) -> tuple[float, float]:
    """(engine seconds, CPU issue seconds) for each queue's issue(stream) held behind a sleep;
    with threads, each queue is issued from its own thread (ctypes lets go of the GIL); with
    same_stream, the sleep runs on the first queue's stream (no cross-stream wait at all)."""
    gate = queues[0][0] if same_stream else torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(gate):
        torch.cuda._sleep(SLEEP_CYCLES)
        opened = torch.cuda.Event(enable_timing=True)
        opened.record(gate)
    ends = [torch.cuda.Event(enable_timing=True) for _ in queues]
    for stream, _ in queues:
        if stream is not gate:
            stream.wait_event(opened)
    device = torch.cuda.current_device()

    def one(k: int) -> None:
        torch.cuda.set_device(device)
        stream, issue = queues[k]
        with torch.cuda.stream(stream):  # the kernel launches on the current stream
            issue(stream.cuda_stream)
        ends[k].record(stream)

    started = time.perf_counter()
    if threads:
        pool = [threading.Thread(target=one, args=(k,)) for k in range(len(queues))]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    else:
        for k in range(len(queues)):
            one(k)
    issued = time.perf_counter() - started
    torch.cuda.synchronize()
    return max(opened.elapsed_time(e) for e in ends) / 1e3, issued


def run(block: int, setup: Setup) -> None:
    label = f"{block // KIB}K"
    jobs = {d: batches(setup, d)[:JOBS] for d in ("H2D", "D2H")}
    attrs = {d: attrs_for(d) for d in ("H2D", "D2H")}
    streams = [torch.cuda.Stream() for _ in range(2)]

    def issuer(d: str, parts: list[CopyBatch], per_call: int) -> Callable[[int], None]:
        return lambda stream: [issue_dma(b, attrs[d], stream, fixed(per_call)) for b in parts]

    def report(name: str, nbytes: int, count: int, result: tuple[float, float]) -> None:
        engines, issued = result
        print(
            f"{label} {name}: engines {gbps(nbytes, engines):.1f} GB/s "
            f"({engines / count * 1e6:.2f} us/desc), issue {issued / count * 1e6:.2f} us/desc "
            f"({issued * 1e3:.0f} ms of the sleep's {SLEEP * 1e3:.0f})",
            flush=True,
        )

    for d in ("H2D", "D2H"):
        nbytes = sum(b.total_bytes for b in jobs[d])
        count = sum(b.count for b in jobs[d])
        for per_call in (128, 1 << 20):
            calls = "128/call" if per_call == 128 else "one call/job"
            for _ in range(2):  # the first warms the driver
                result = prequeued([(streams[0], issuer(d, jobs[d], per_call))])
            report(f"{d} {calls} one stream", nbytes, count, result)
        for _ in range(2):
            result = prequeued([(streams[0], issuer(d, jobs[d], 128))], same_stream=True)
        report(f"{d} 128/call one stream, sleep on it", nbytes, count, result)
        halves = [
            [part(b, 0, b.count // 2) for b in jobs[d]],
            [part(b, b.count // 2, b.count) for b in jobs[d]],
        ]
        for _ in range(2):
            result = prequeued(
                [(s, issuer(d, h, 128)) for s, h in zip(streams, halves, strict=True)]
            )
        report(f"{d} 128/call two streams", nbytes, count, result)
        for _ in range(2):
            result = prequeued(
                [(s, issuer(d, h, 128)) for s, h in zip(streams, halves, strict=True)], threads=True
            )
        report(f"{d} 128/call two streams from two threads", nbytes, count, result)
    both_bytes = sum(b.total_bytes for d in jobs for b in jobs[d])
    both_count = sum(b.count for d in jobs for b in jobs[d])
    for _ in range(2):
        result = prequeued(
            [(s, issuer(d, jobs[d], 128)) for s, d in zip(streams, jobs, strict=True)]
        )
    report("both ways 128/call", both_bytes, both_count, result)


def hybrid(block: int, setup: Setup) -> None:
    """One direction split between the copy kernel (a share of each job's copies) and the
    copy engines (the rest), both queued behind the sleep: can the two paths together pass
    either alone, the CPU's issue cost aside?"""
    label = f"{block // KIB}K"
    kernel = KernelBackend(torch.device("cuda", 0))
    streams = [torch.cuda.Stream() for _ in range(2)]
    for d in ("H2D", "D2H"):
        attrs = attrs_for(d)
        jobs = [pinned(b) for b in batches(setup, d)[:JOBS]]
        nbytes = sum(b.total_bytes for b in jobs)
        for share in (1.0, 0.9, 0.8, 0.7, 0.5, 0.0):
            heads = [(b, int(b.count * share)) for b in jobs]
            tails = [part(b, k, b.count) for b, k in heads if k < b.count]

            def by_kernel(_: int, heads: list[tuple[CopyBatch, int]] = heads) -> None:
                for b, k in heads:
                    if k:
                        kernel.launch(b.table, 0, k, block)

            def by_dma(stream: int, tails: list[CopyBatch] = tails, attrs: object = attrs) -> None:
                for b in tails:
                    issue_dma(b, attrs, stream, fixed(128))

            for _ in range(2):
                engines, issued = prequeued(list(zip(streams, (by_kernel, by_dma), strict=True)))
            print(
                f"{label} {d} kernel {share:.0%} + engines {1 - share:.0%}: "
                f"{gbps(nbytes, engines):.1f} GB/s (issue {issued * 1e3:.0f} ms)",
                flush=True,
            )


def live_hybrid(block: int, setup: Setup) -> None:
    """The split of `hybrid`, live: each job's engine share is issued first (the CPU's cost
    per descriptor is what limits the engines), then the kernel is launched for the rest."""
    label = f"{block // KIB}K"
    kernel = KernelBackend(torch.device("cuda", 0))
    streams = [torch.cuda.Stream() for _ in range(2)]
    for d in ("H2D", "D2H"):
        attrs = attrs_for(d)
        jobs = [pinned(b) for b in batches(setup, d)]
        nbytes = sum(b.total_bytes for b in jobs)
        for share in (1.0, 0.9, 0.8, 0.7):
            heads = [(b, int(b.count * share)) for b in jobs]
            tails = [part(b, k, b.count) for b, k in heads]

            def issue(
                heads: list[tuple[CopyBatch, int]] = heads,
                tails: list[CopyBatch] = tails,
                attrs: object = attrs,
            ) -> None:
                for (b, k), tail in zip(heads, tails, strict=True):
                    if tail.count:
                        issue_dma(tail, attrs, streams[1].cuda_stream, fixed(128))
                    if k:
                        with torch.cuda.stream(streams[0]):
                            kernel.launch(b.table, 0, k, block)

            rate = gbps(nbytes, median_seconds(lambda i=issue: wall(i), 5))
            print(
                f"{label} {d} live kernel {share:.0%} + engines {1 - share:.0%}: {rate:.1f} GB/s",
                flush=True,
            )


def issue_under_load(block: int, setup: Setup) -> None:
    """The CPU's cost per descriptor, queued behind the sleep, while the link is idle and
    while a long copy by the engines or the kernel keeps it busy: does traffic on the link
    slow the driver's issue?"""
    label = f"{block // KIB}K"
    kernel = KernelBackend(torch.device("cuda", 0))
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    device_buffer = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    whole = CopyBatch.allocate(1, pinned=True)
    load_stream, gated = torch.cuda.Stream(), torch.cuda.Stream()
    for d in ("H2D", "D2H"):
        attrs = attrs_for(d)
        jobs = batches(setup, d)[:JOBS]
        count = sum(b.count for b in jobs)
        for load in ("idle", "engines H2D", "engines D2H", "kernel H2D", "kernel D2H"):
            src, dst = (host, device_buffer) if "H2D" in load else (device_buffer, host)
            whole.rows[:, 0] = [src.data_ptr(), dst.data_ptr(), src.numel()]
            torch.cuda.synchronize()
            with torch.cuda.stream(load_stream):
                if load.startswith("engines"):
                    issue_dma(whole, attrs_for(load[-3:]), load_stream.cuda_stream, fixed(1))
                elif load.startswith("kernel"):
                    kernel.launch(whole.table, 0, 1, src.numel())
            time.sleep(0.002)  # the long copy is under way (~20 ms for 1 GiB)
            with torch.cuda.stream(gated):
                torch.cuda._sleep(SLEEP_CYCLES)
            started = time.perf_counter()
            for b in jobs:
                issue_dma(b, attrs, gated.cuda_stream, fixed(128))
            issued = time.perf_counter() - started
            torch.cuda.synchronize()
            print(
                f"{label} {d} issue while the link is {load}: {issued / count * 1e6:.2f} us/desc",
                flush=True,
            )


SLEEP = 0.0


PARTS = {"engines": run, "hybrid": hybrid, "load": issue_under_load}


def main() -> None:
    global SLEEP
    args = sys.argv[1:]
    blocks = [int(a) * KIB for a in args if a.isdigit()] or [16 * KIB, 32 * KIB, 64 * KIB]
    parts = [a for a in args if not a.isdigit()] or [*PARTS, "live"]
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    SLEEP = sleep_seconds()
    rng = np.random.default_rng(1)
    for block in blocks:
        setup = make_setup(block, "/dev/shm", rng, pass_bytes=BURST_BYTES)
        try:
            for name in parts:
                if name in PARTS:
                    PARTS[name](block, setup)
        finally:
            setup.close()
        if "live" in parts:
            setup = make_setup(block, "/dev/shm", rng)  # 1 GiB per timing
            try:
                live_hybrid(block, setup)
            finally:
                setup.close()


if __name__ == "__main__":
    main()
