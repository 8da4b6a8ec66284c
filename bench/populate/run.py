"""Whole-region populate: kvshm's parallel MADV_POPULATE_WRITE vs a vLLM-style loop.

The baseline is what a serving process does without kvshm: one thread, one madvise per row.
Both populate a fresh file of the same size and layout on the same tmpfs, in the same run.

    python bench/populate/run.py --gib 8 [--directory /dev/shm] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from kvshm.region import RegionLayout, SharedOffloadRegion, memory
from kvshm.region.populate import Populator, default_threads

CPU_PAGE = 64 * 1024
WORKERS = 4


def fresh_region(directory: str, gib: float) -> SharedOffloadRegion:
    blocks = int(gib * 1024**3) // (CPU_PAGE * WORKERS)
    return SharedOffloadRegion(
        f"bench-{os.getpid()}",
        RegionLayout(blocks, CPU_PAGE, WORKERS),
        directory=directory,
        mode="create",
        populate=False,
    )


def per_row_loop(region: SharedOffloadRegion) -> None:
    stride = region.layout.row_stride
    for block in range(region.layout.num_blocks):
        memory.madvise(region.address + block * stride, stride, memory.MADV_POPULATE_WRITE)


def parallel(region: SharedOffloadRegion, threads: int) -> None:
    Populator(region.address, region.mapped_files(), threads=threads).populate(
        [(0, region.layout.size_bytes)]
    )


def timed(directory: str, gib: float, run: object, repeat: int) -> tuple[float, int]:
    seconds = []
    for _ in range(repeat):
        region = fresh_region(directory, gib)
        try:
            started = time.perf_counter()
            run(region)  # type: ignore[operator]
            seconds.append(time.perf_counter() - started)
            assert region.resident_bytes() == region.layout.size_bytes
            size = region.layout.size_bytes
        finally:
            region.cleanup()
    return statistics.median(seconds), size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--directory", default="/dev/shm")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="kvshm-bench-", dir=args.directory)
    cores = len(os.sched_getaffinity(0))
    print(
        f"populate {args.gib} GiB, {WORKERS} workers x {CPU_PAGE} B cells, {cores} cores, "
        f"median of {args.repeat}"
    )
    base_s, size = timed(directory, args.gib, per_row_loop, args.repeat)
    print(f"{'method':<34}{'seconds':>9}{'GB/s':>8}{'ratio':>8}")
    print(
        f"{'baseline: 1 thread, madvise/row':<34}{base_s:>9.3f}{size / base_s / 1e9:>8.2f}"
        f"{1.0:>8.2f}"
    )
    thread_counts = sorted({1, 2, 4, 8, default_threads()} & set(range(1, default_threads() + 1)))
    for threads in thread_counts:
        secs, _ = timed(directory, args.gib, lambda r, t=threads: parallel(r, t), args.repeat)
        label = f"kvshm: {threads} threads" + (" (default)" if threads == default_threads() else "")
        print(f"{label:<34}{secs:>9.3f}{size / secs / 1e9:>8.2f}{base_s / secs:>8.2f}")
    os.rmdir(directory)


if __name__ == "__main__":
    main()
