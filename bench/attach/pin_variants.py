"""Where attach + pin time goes: variants of registering an agent-populated region with CUDA.

An agent process holds a populated, locked region; this process attaches it fresh for each
variant (no page-table entries yet) and times prefaulting and registration separately.

    python bench/attach/pin_variants.py --gib 16 [--directory /dev/shm]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from run import agent, open_region  # type: ignore[import-not-found]

from kvshm.region import SharedOffloadRegion
from kvshm.region.populate import Populator


def register(region: SharedOffloadRegion, chunk_bytes: int, threads: int) -> None:
    cudart = torch.cuda.cudart()
    chunks = region.layout.row_aligned_chunks(chunk_bytes)

    def one(chunk: tuple[int, int]) -> None:
        code = int(cudart.cudaHostRegister(region.address + chunk[0], chunk[1], 0))
        assert code == 0, code

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, chunks))
    for offset, _ in chunks:
        cudart.cudaHostUnregister(region.address + offset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--directory", default="/dev/shm")
    args = parser.parse_args()
    torch.cuda.init()
    directory = tempfile.mkdtemp(prefix="kvshm-bench-", dir=args.directory)
    ctx = multiprocessing.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    process = ctx.Process(target=agent, args=(directory, args.gib, ready, done))
    process.start()
    ready.wait()
    gib = 1024**3
    variants = [
        ("register 1 x 64 GiB chunk", False, 64 * gib, 1),
        ("register 16 x 1 GiB, 1 thread", False, gib, 1),
        ("register 16 x 1 GiB, 16 threads", False, gib, 16),
        ("prefault + 1 x 64 GiB", True, 64 * gib, 1),
        ("prefault + 16 x 1 GiB, 16 threads", True, gib, 16),
        ("prefault + 64 x 256 MiB, 16 threads", True, gib // 4, 16),
    ]
    print(f"{args.gib} GiB, {torch.cuda.get_device_name()}, {len(os.sched_getaffinity(0))} cores")
    print(f"{'variant':<40}{'prefault s':>11}{'register s':>11}{'total s':>9}")
    for label, prefault, chunk, threads in variants:
        region = open_region(directory, args.gib, mode="attach")
        started = time.perf_counter()
        if prefault:
            Populator(region.address, region.mapped_files(), threads=16).populate(
                [(0, region.layout.size_bytes)]
            )
        mid = time.perf_counter()
        register(region, chunk, threads)
        end = time.perf_counter()
        region.cleanup()
        print(f"{label:<40}{mid - started:>11.3f}{end - mid:>11.3f}{end - started:>9.3f}")
    done.set()
    process.join()
    os.rmdir(directory)


if __name__ == "__main__":
    main()
