"""The kvshm vLLM plugin's worker on a region of 2 MiB huge pages against one of 4 KiB pages
(issue 35: neither may get worse on huge pages), in the same run, on vLLM 0.33's layouts of
real models (tests/vllm_plugin/layouts.py):

- per layout and root, the plugin's worker end to end on an agent-made region (bench/vllm_plugin/
  run.py's (c)): GB/s H2D, D2H and both (median of three rounds of --reps passes each), and
  beside bf16 matrix products the milliseconds they lose per GB moved; its background CUDA
  registration of the region and how long the first transfer waited for it;
- engine start at TP 4, rank 0, on a --start-gib region: the registration each root needs.

The 4 KiB root is --directory (the node's /dev/shm); the huge-page one a tmpfs mounted
huge=within_size for the run (root needed) or --huge-directory. Ratios are huge over 4 KiB.

On a machine without CUDA it runs at a small size with KV caches in CPU memory and the plugin's
CPU copy backend: the GB/s then compare memmove into each root, not a GPU link, and there is no
registration and no products (it says so). Needs vLLM 0.33's worker modules like run.py.

    source .gpu/env.sh && python3 bench/vllm_plugin/pages.py [--layouts a,b]
        [--gib 2] [--start-gib 64] [--huge-directory DIR] [--json FILE]
    python bench/vllm_plugin/pages.py --quick     # a CPU box: small, no GPU parts
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

import torch  # noqa: E402
from bench.common.pages import describe_root, free_page_reporting, huge_root  # noqa: E402
from bench.vllm_plugin.jobs import Plan, issue_and_wait, plan  # noqa: E402
from bench.vllm_plugin.run import (  # noqa: E402
    DIRECTIONS,
    GIB,
    SHM,
    blocks_for,
    build_plugin,
    delay,
    gbps,
    measure,
)
from tests.vllm_plugin.layouts import REAL_LAYOUTS, KvLayout, canonical_kv_caches  # noqa: E402

DEFAULT_LAYOUTS = ("llama-3.1-8b-tp1", "llama-3.1-70b-tp4-rank0", "2mib-blocks")
ROOTS = ("4 KiB", "2 MiB")
CONTROL = "4 KiB again"  # --control: the 4 KiB root once more, after the 2 MiB one (A-B-A)


def measure_cpu(worker: Any, jobs: Plan, reps: int) -> dict[str, Any]:
    """Without CUDA: GB/s per direction from the submit to the last job's end (wait)."""
    out: dict[str, Any] = {}
    for direction in DIRECTIONS:
        stores, loads = jobs.jobs[direction]
        issue_and_wait(worker, stores, loads)  # warm-up
        seconds = []
        for _ in range(reps):
            started = time.perf_counter()
            issue_and_wait(worker, stores, loads)
            seconds.append(time.perf_counter() - started)
        out[direction] = {"GBps": gbps(jobs.nbytes[direction], statistics.median(seconds))}
    return out


def bench_layout(
    layout: KvLayout, roots: dict[str, str], args: argparse.Namespace, compute: Any
) -> dict[str, Any]:
    cuda = compute is not None
    workers = 4 if "tp4" in layout.name else 1
    blocks = blocks_for(layout, args.gib, workers)
    cell = layout.worker_bytes_per_block
    kv = canonical_kv_caches(layout, blocks, "cuda" if cuda else "cpu")
    jobs = plan(layout, blocks, args.job_blocks, seed=len(layout.name))
    row: dict[str, Any] = {"layout": layout.name, "blocks": blocks, "workers": workers,
                           "region_bytes": blocks * cell * workers}  # fmt: skip
    for name, directory in roots.items():
        built = build_plugin(kv, blocks, cell, workers, directory)
        try:
            first = time.perf_counter()
            issue_and_wait(built.worker, jobs.jobs["D2H"][0][:1], [])
            pin = built.worker.pin
            row[name] = {
                "first_transfer_s": time.perf_counter() - first,
                "first_transfer_waited_s": built.worker.first_transfer_wait_seconds,
                "registration_s": pin.pin_seconds if pin else None,
                "pinned": bool(pin and pin.pinned),
                **(
                    measure(built, jobs, compute, args.reps, args.beside_reps)
                    if cuda
                    else measure_cpu(built.worker, jobs, args.reps)
                ),
            }
        finally:
            built.close()
    del kv
    if cuda:
        torch.cuda.empty_cache()
    return row


def print_layout(row: dict[str, Any]) -> None:
    print(
        f"\n== {row['layout']}: {row['blocks']} blocks, region {row['region_bytes'] / GIB:.2f} "
        f"GiB ({row['workers']} worker cells per row)"
    )
    print(
        f"{'':6} {'GB/s 4 KiB':>11} {'2 MiB':>8} {'2M/4K':>7} "
        f"{'ms/GB beside 4 KiB':>22} {'2 MiB':>21}"
    )
    small, huge = row[ROOTS[0]], row[ROOTS[1]]
    for d in DIRECTIONS:
        beside = [delay(r[d] if "matmul_delay_quartiles" in r[d] else None) for r in (small, huge)]
        print(
            f"{d:6} {small[d]['GBps']:>11.1f} {huge[d]['GBps']:>8.1f} "
            f"{huge[d]['GBps'] / small[d]['GBps']:>7.2f} {beside[0]:>22} {beside[1]:>21}"
        )
    if CONTROL in row:
        again = row[CONTROL]
        for d in DIRECTIONS:
            both = (small[d]["GBps"] + again[d]["GBps"]) / 2
            print(
                f"{d:6} A-B-A: 4 KiB again {again[d]['GBps']:.1f} GB/s, 4 KiB again / 4 KiB "
                f"{again[d]['GBps'] / small[d]['GBps']:.3f}; 2 MiB / both 4 KiB "
                f"{huge[d]['GBps'] / both:.3f}; ms/GB beside 4 KiB again "
                f"{delay(again[d] if 'matmul_delay_quartiles' in again[d] else None)}"
            )
    for name in (name for name in (*ROOTS, CONTROL) if name in row):
        figures = row[name]
        if figures["registration_s"] is not None and figures["pinned"]:
            print(
                f"{name} pages: registration {figures['registration_s']:.3f}s in the background, "
                f"first transfer waited {figures['first_transfer_waited_s'] or 0:.3f}s"
            )


def bench_start(gib: float, roots: dict[str, str]) -> dict[str, Any]:
    """The plugin's start at TP 4 (rank 0) on each root: its background registration."""
    layout = REAL_LAYOUTS[2]  # Llama-3.1-70B TP4 rank 0
    workers, cell = 4, layout.worker_bytes_per_block
    chunks = int(gib * GIB // (cell * workers))
    kv = canonical_kv_caches(layout, 64, "cuda")
    row: dict[str, Any] = {"region_bytes": chunks * cell * workers}
    for name in ROOTS:
        directory = roots[name]
        built = build_plugin(kv, chunks, cell, workers, directory)
        try:
            built.worker.pin.wait()
            pin = built.worker.pin
            row[name] = {"blocking_s": built.blocking_seconds, "registration_s": pin.pin_seconds}
        finally:
            built.close()
    small, huge = row[ROOTS[0]]["registration_s"], row[ROOTS[1]]["registration_s"]
    print(
        f"\n== start, TP 4 rank 0, region {row['region_bytes'] / GIB:.1f} GiB: registration "
        f"{small:.2f}s on 4 KiB pages, {huge:.2f}s on 2 MiB pages ({small / huge:.2f}x)"
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layouts", help=f"comma-separated names (default: {','.join(DEFAULT_LAYOUTS)})"
    )
    parser.add_argument("--gib", type=float, help="KV per layout, GiB (default 2; --quick 0.0625)")
    parser.add_argument("--job-blocks", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--beside-reps", type=int, default=9)
    parser.add_argument("--directory", default=SHM, help="the 4 KiB root (default /dev/shm)")
    parser.add_argument("--huge-directory", help="a tmpfs with huge pages (default: mount one)")
    parser.add_argument(
        "--start-gib", type=float, default=64.0, help="region for the start-up figure (0: skip)"
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="measure the 4 KiB root again after the 2 MiB one: the run's own spread (A-B-A)",
    )
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--quick", action="store_true", help="small; on a CPU box, no GPU parts")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        sys.exit("bench/vllm_plugin/pages.py needs a CUDA device (or --quick on a CPU box)")
    args.gib = args.gib or (0.0625 if args.quick else 2.0)
    if args.quick:
        args.reps = min(args.reps, 2)
    names = args.layouts.split(",") if args.layouts else DEFAULT_LAYOUTS
    layouts = [layout for layout in REAL_LAYOUTS if layout.name in names]
    if not layouts:
        sys.exit(f"no layout matches {args.layouts!r}: {[x.name for x in REAL_LAYOUTS]}")
    device = torch.cuda.get_device_name() if cuda else "no CUDA"
    print(f"device: {device}; torch {torch.__version__}")
    if not cuda:
        print(
            "NOTE: no CUDA device: KV caches in CPU memory and the plugin's CPU copy backend, so "
            "GB/s compare memmove into each root; no registration, no products beside"
        )
    compute = None
    if cuda:
        from bench.common.gpu import Compute

        compute = Compute()
    size = max(
        blocks_for(layout, args.gib, 4 if "tp4" in layout.name else 1)
        * layout.worker_bytes_per_block
        * (4 if "tp4" in layout.name else 1)
        for layout in layouts
    )
    start_size = int(args.start_gib * GIB) if cuda and args.start_gib > 0 and not args.quick else 0
    with huge_root(max(size, start_size), args.huge_directory) as huge_dir:
        roots = dict(zip(ROOTS, (args.directory, huge_dir), strict=True))
        if args.control:
            roots[CONTROL] = args.directory
        for name, directory in roots.items():
            print(f"{name} root: {describe_root(directory)}")
        reporting = free_page_reporting()
        if reporting:
            print(f"NOTE: {reporting}")
        rows = []
        for layout in layouts:
            row = bench_layout(layout, roots, args, compute)
            print_layout(row)
            rows.append(row)
        start = bench_start(args.start_gib, roots) if start_size else None
    print("\n(goal, issue 35: on 2 MiB pages GB/s not lower, ms/GB beside not higher than 4 KiB)")
    if args.json:
        figures = {"layouts": rows, "start": start}
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))


if __name__ == "__main__":
    main()
