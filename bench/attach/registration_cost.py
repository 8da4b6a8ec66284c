"""What CUDA registration of a region costs, taken apart: per call and per byte, on 4 KiB pages
(--directory, the node's /dev/shm) against 2 MiB pages (a huge-page tmpfs mounted for the run, or
--huge-directory), from one process and from --ranks processes at once on one GPU.

A file of --gib in Llama-3.1-70B TP 4 rows (5 MiB rows of four 1.25 MiB cells) is made on each
root and mapped; each process maps its pages first (MADV_POPULATE_WRITE, timed on its own), then
registers and unregisters these range shapes with cudaHostRegister, timing each call:

- whole: the file in one call;
- cells: rank 0's cell of every row, a call each (what a TP 4 worker registers);
- rows: every whole row, a call each (the cells' calls with 4x the bytes);
- pages: one 4 KiB page at every cell (the cells' calls with almost no bytes);
- cells_unmapped: the cells again in a process that did not map the pages first (the driver
  faults them in itself);
- window: rank 0's cells mapped a second time, back to back (one MAP_FIXED mapping a cell), and
  registered in one call: what fewer calls would save, and what mapping them so costs.

From these, per page size: the fixed cost of a call (pages), the cost per MiB ((rows - cells) /
the bytes between them), and what mapping the pages first costs. With --ranks N the cells and
the whole file are registered by N processes at once, each its own rank's cells, on one GPU.

    source .gpu/env.sh && python3 bench/attach/registration_cost.py
        [--gib 16] [--ranks 4] [--directory /dev/shm] [--huge-directory DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common.pages import describe_root, huge_root  # noqa: E402

from kvshm.region import memory  # noqa: E402
from kvshm.region.pinning import CudaRegistration, cuda_runtime  # noqa: E402

MIB = 1 << 20
ROW_BYTES = 5 * MIB
CELL_BYTES = ROW_BYTES // 4
SHAPES = ("whole", "cells", "rows", "pages")


def shapes(size: int, rank: int) -> dict[str, list[tuple[int, int]]]:
    rows = range(size // ROW_BYTES)
    cell = rank * CELL_BYTES
    return {
        "whole": [(0, size)],
        "cells": [(r * ROW_BYTES + cell, CELL_BYTES) for r in rows],
        "rows": [(r * ROW_BYTES, ROW_BYTES) for r in rows],
        "pages": [(r * ROW_BYTES + cell, memory.PAGE_SIZE) for r in rows],
    }


def register_each(cudart: Any, address: int, ranges: list[tuple[int, int]]) -> dict[str, float]:
    """Register every range, a call each, then unregister them; seconds and µs a call."""
    registration = CudaRegistration(cudart, address, ranges)
    started = time.perf_counter()
    registration.register()
    registered = time.perf_counter() - started
    started = time.perf_counter()
    registration.unregister()
    return {
        "calls": len(ranges),
        "register_s": registered,
        "unregister_s": time.perf_counter() - started,
        "us_per_call": 1e6 * registered / len(ranges),
    }


def map_window(fd: int, cells: list[tuple[int, int]]) -> tuple[mmap.mmap, int]:
    """The cells of fd mapped back to back in a fresh range: (its reservation, its address)."""
    length = sum(size for _, size in cells)
    reservation = mmap.mmap(-1, length, mmap.MAP_PRIVATE | memory.MAP_NORESERVE)
    address = at = memory.mapping_address(reservation)
    for offset, size in cells:
        memory.map_file_at(at, size, fd, offset)
        at += size
    return reservation, address


def register_window(cudart: Any, fd: int, cells: list[tuple[int, int]]) -> dict[str, float]:
    """Map the cells back to back, map their pages, register the range in one call."""
    started = time.perf_counter()
    reservation, address = map_window(fd, cells)
    length = sum(size for _, size in cells)
    mapped = time.perf_counter()
    memory.madvise(address, length, memory.MADV_POPULATE_WRITE)
    paged = time.perf_counter()
    figures = register_each(cudart, address, [(0, length)])
    reservation.close()
    return {
        "map_cells_s": mapped - started,
        "map_pages_s": paged - mapped,
        "register_s": figures["register_s"],
        "unregister_s": figures["unregister_s"],
    }


def rank_process(
    path: str, size: int, rank: int, names: list[str], map_first: bool, start: Any, results: Any
) -> None:
    cudart, reason = cuda_runtime()
    if cudart is None:
        raise SystemExit(reason)
    import torch

    torch.zeros(1, device="cuda")  # the context, and the driver's first registration, untimed
    with mmap.mmap(-1, 2 * MIB) as warm_up:
        register_each(cudart, memory.mapping_address(warm_up), [(0, 2 * MIB)])
    fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    address = memory.mapping_address(mapping)
    out: dict[str, Any] = {"rank": rank}
    if map_first:
        started = time.perf_counter()
        memory.madvise(address, size, memory.MADV_POPULATE_WRITE)
        out["map_pages_s"] = time.perf_counter() - started
    ranges = shapes(size, rank)
    for name in names:
        if start is not None:
            start.wait()
        out[name] = register_each(cudart, address, ranges[name])
    if map_first and start is None:
        out["window"] = register_window(cudart, fd, ranges["cells"])
    results.put(out)


def run(path: str, size: int, ranks: int, names: list[str], map_first: bool) -> list[Any]:
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    start = spawn.Barrier(ranks) if ranks > 1 else None
    processes = [
        spawn.Process(
            target=rank_process, args=(path, size, rank, names, map_first, start, results)
        )
        for rank in range(ranks)
    ]
    for process in processes:
        process.start()
    collected = [results.get(timeout=600) for _ in processes]
    for process in processes:
        process.join()
    return collected


def make_file(path: str, size: int) -> float:
    """The region's bytes, populated as the agent populates them; seconds taken."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapping:
            started = time.perf_counter()
            memory.madvise(memory.mapping_address(mapping), size, memory.MADV_POPULATE_WRITE)
            return time.perf_counter() - started
    finally:
        os.close(fd)


def measure_root(directory: str, size: int, ranks: int) -> dict[str, Any]:
    path = os.path.join(directory, f"kvshm-bench-registration-{os.getpid()}")
    try:
        figures: dict[str, Any] = {"populate_s": make_file(path, size)}
        figures["one"] = run(path, size, 1, list(SHAPES), map_first=True)[0]
        figures["cells_unmapped"] = run(path, size, 1, ["cells"], map_first=False)[0]["cells"]
        if ranks > 1:
            figures["concurrent"] = run(path, size, ranks, ["cells", "whole"], map_first=True)
        return figures
    finally:
        os.unlink(path)


def report(name: str, figures: dict[str, Any], ranks: int) -> None:
    one = figures["one"]
    fixed = one["pages"]["us_per_call"]
    per_mib = (one["rows"]["us_per_call"] - one["cells"]["us_per_call"]) / (
        (ROW_BYTES - CELL_BYTES) / MIB
    )
    print(f"\n{name} pages: one process, its pages mapped first in {one['map_pages_s']:.3f} s")
    for shape in SHAPES:
        f = one[shape]
        print(
            f"  {shape:<6} {f['calls']:>6} calls  {f['register_s']:.3f} s  "
            f"{f['us_per_call']:>10.1f} µs a call  (unregister {f['unregister_s']:.3f} s)"
        )
    unmapped = figures["cells_unmapped"]
    print(f"  cells, pages not mapped first: {unmapped['register_s']:.3f} s")
    print(f"  a call costs {fixed:.1f} µs and {per_mib:.1f} µs a MiB")
    window = one["window"]
    print(
        f"  cells mapped back to back: mapping them {window['map_cells_s']:.3f} s, their pages "
        f"{window['map_pages_s']:.3f} s, one registration {window['register_s']:.3f} s"
    )
    for shape in ("cells", "whole") if "concurrent" in figures else ():
        slowest = max(rank[shape]["register_s"] for rank in figures["concurrent"])
        print(f"  {ranks} processes at once, {shape}: the slowest {slowest:.3f} s")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--ranks", type=int, default=4, help="processes registering at once")
    parser.add_argument("--directory", default="/dev/shm", help="the 4 KiB root")
    parser.add_argument("--huge-directory", help="a tmpfs with huge pages (default: mount one)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    size = int(args.gib * (1 << 30)) // ROW_BYTES * ROW_BYTES
    report_out: dict[str, Any] = {"gib": args.gib, "ranks": args.ranks}
    with huge_root(size, args.huge_directory) as huge_dir:
        for name, directory in (("4 KiB", args.directory), ("2 MiB", huge_dir)):
            print(describe_root(directory))
            report_out[name] = measure_root(directory, size, args.ranks)
            report(name, report_out[name], args.ranks)
    if args.json:
        Path(args.json).write_text(json.dumps(report_out, indent=2))


if __name__ == "__main__":
    main()
