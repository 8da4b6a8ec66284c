"""Registering one worker's cells vs the whole region with CUDA, after attaching a region the
agent populated (fresh page tables, as a serving worker finds it).

For each (cell, workers) geometry an agent process creates, populates and locks a vllm-0.33
region; this process attaches as rank 0 and times pin() (whole rows) and pin(cells_only=True)
with the threshold lifted, so both are measured wherever they differ.

    python bench/attach/pin_cells.py --gib 16 [--directory /dev/shm]
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from typing import Any

import torch

import kvshm.region.layout as layout_module
from kvshm.region import RegionLayout, SharedOffloadRegion

KIB, MIB, GIB = 1024, 1024**2, 1024**3
GEOMETRIES = [  # (name, cell, workers)
    ("llama-3.1-70b tp4: 1.25 MiB cells", 1280 * KIB, 4),
    ("2 MiB cells tp2", 2 * MIB, 2),
    ("qwen2.5-7b tp2: 448 KiB cells", 448 * KIB, 2),
    ("64 KiB cells tp4", 64 * KIB, 4),
]


def layout_for(gib: float, cell: int, workers: int) -> RegionLayout:
    return RegionLayout(int(gib * GIB) // (cell * workers), cell, workers)


def agent(directory: str, layout: RegionLayout, ready: Any, done: Any) -> None:
    region = SharedOffloadRegion("pin-cells", layout, directory=directory, mode="create")
    region.lock()
    ready.set()
    done.wait()
    region.cleanup()


def timed_pin(directory: str, layout: RegionLayout, cells_only: bool) -> tuple[float, int]:
    region = SharedOffloadRegion("pin-cells", layout, 0, directory=directory, mode="attach")
    started = time.perf_counter()
    assert region.pin(cells_only=cells_only), "pinning failed: is CUDA visible?"
    seconds = time.perf_counter() - started
    pinned = region.pinned_bytes
    region.cleanup()
    return seconds, pinned


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--directory", default="/dev/shm")
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    torch.cuda.init()
    layout_module.MIN_UNREGISTERED_BYTES_PER_ROW = 1  # measure cells alone wherever they differ
    print(f"{args.gib} GiB, {torch.cuda.get_device_name()}, best of {args.repeat}")
    ctx = multiprocessing.get_context("spawn")
    for name, cell, workers in GEOMETRIES:
        layout = layout_for(args.gib, cell, workers)
        directory = tempfile.mkdtemp(prefix="kvshm-bench-", dir=args.directory)
        ready, done = ctx.Event(), ctx.Event()
        process = ctx.Process(target=agent, args=(directory, layout, ready, done))
        process.start()
        ready.wait()
        rows = []
        for cells_only in (False, True):
            runs = [timed_pin(directory, layout, cells_only) for _ in range(args.repeat)]
            seconds = min(s for s, _ in runs)
            rows.append(
                f"{'cells' if cells_only else 'whole'} {runs[0][1] / GIB:.2f} GiB "
                f"in {seconds:.3f} s"
            )
        done.set()
        process.join()
        print(f"{name} (row {layout.row_stride} B, {layout.num_blocks} rows): " + "; ".join(rows))


if __name__ == "__main__":
    main()
