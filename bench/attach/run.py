"""Attach + pin of a region the agent already populated vs create + populate + pin from scratch.

Run on a GPU machine (pinning is cudaHostRegister). The "agent" is a separate process that
creates, populates and locks the region, as the kvshm agent does; the serving process then
attaches and pins. From scratch, the serving process creates, populates and pins it itself:
once with kvshm's parallel populate, once with a vLLM-style single-threaded per-row loop.

    python bench/attach/run.py --gib 16 [--directory /dev/shm] [--repeat 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kvshm.region import RegionLayout, SharedOffloadRegion, memory

CPU_PAGE = 256 * 1024
WORKERS = 4


def geometry(gib: float) -> tuple[int, int]:
    blocks = int(gib * 1024**3) // (CPU_PAGE * WORKERS)
    return blocks, blocks * CPU_PAGE * WORKERS


def open_region(directory: str, gib: float, **kwargs: Any) -> SharedOffloadRegion:
    blocks, _ = geometry(gib)
    layout = RegionLayout(blocks, CPU_PAGE, WORKERS)
    return SharedOffloadRegion("attach-bench", layout, directory=directory, **kwargs)


def agent(directory: str, gib: float, ready: Any, done: Any) -> None:
    region = open_region(directory, gib, mode="create")
    region.lock()
    ready.set()
    done.wait()
    region.cleanup()


def per_row_loop(region: SharedOffloadRegion) -> None:
    stride = region.layout.row_stride
    for block in range(region.layout.num_blocks):
        memory.madvise(region.address + block * stride, stride, memory.MADV_POPULATE_WRITE)


def scratch(directory: str, gib: float, populate: Callable[[SharedOffloadRegion], None]) -> float:
    started = time.perf_counter()
    region = open_region(directory, gib, mode="create", populate=False)
    populate(region)
    assert region.pin(), "pinning failed: is CUDA visible?"
    seconds = time.perf_counter() - started
    region.cleanup()
    return seconds


def attach_and_pin(directory: str, gib: float) -> tuple[float, float]:
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    process = ctx.Process(target=agent, args=(directory, gib, ready, done))
    process.start()
    ready.wait()
    started = time.perf_counter()
    region = open_region(directory, gib, mode="attach")
    attached = time.perf_counter()
    assert region.populate_method is None, "the agent's region should need no populate"
    assert region.pin(), "pinning failed: is CUDA visible?"
    seconds = time.perf_counter() - started
    region.cleanup()
    done.set()
    process.join()
    return seconds, attached - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--directory", default="/dev/shm")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    import torch

    torch.cuda.init()  # CUDA context creation is not part of either path
    directory = tempfile.mkdtemp(prefix="kvshm-bench-", dir=args.directory)
    rows = []
    attach = [attach_and_pin(directory, args.gib) for _ in range(args.repeat)]
    attach_s = statistics.median(s for s, _ in attach)
    attach_only_s = statistics.median(a for _, a in attach)
    par_s = statistics.median(
        scratch(directory, args.gib, lambda r: r.populate()) for _ in range(args.repeat)
    )
    loop_s = statistics.median(
        scratch(directory, args.gib, per_row_loop) for _ in range(args.repeat)
    )
    rows = [
        ("attach + pin (agent populated)", attach_s),
        ("  of which attach", attach_only_s),
        ("scratch: parallel populate + pin", par_s),
        ("scratch: per-row loop + pin", loop_s),
    ]
    print(
        f"{args.gib} GiB region, {WORKERS} workers x {CPU_PAGE} B cells, "
        f"{len(os.sched_getaffinity(0))} cores, {torch.cuda.get_device_name()}, "
        f"median of {args.repeat}"
    )
    for label, seconds in rows:
        print(f"{label:<36}{seconds:>9.3f} s")
    print(f"speed-up vs scratch with parallel populate: {par_s / attach_s:.1f}x")
    print(f"speed-up vs scratch with per-row loop:      {loop_s / attach_s:.1f}x")
    os.rmdir(directory)


if __name__ == "__main__":
    main()
