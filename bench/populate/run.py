"""Whole-region populate of a segmented (vllm-0.33) region: the kvshm agent's vs vLLM 0.33's own,
and the agent's on 2 MiB huge pages against 4 KiB ones.

Every method makes a fresh region of the same size and layout, in its own process, one region
at a time (the previous one is gone first), in the same run:

- kvshm agent, 4 KiB pages: kvshm's `SharedOffloadRegion(mode="create")` on --directory (the
  node's /dev/shm), which creates the region's files and populates them with the agent's
  parallel MADV_POPULATE_WRITE (pieces round-robin over the files, so each thread works in a
  file of its own; default threads: one per core, at most 8).
- kvshm agent, 2 MiB pages: the same on a tmpfs mounted huge=within_size (mounted for the run,
  or --huge-directory): the region root the chart's regionRootMount makes (issue 35).
- vLLM 0.33, rank None: vLLM's own `SharedOffloadRegion(engine_id, num_chunks, None, ...,
  num_segments=32)` on --directory: its creator populates the whole region in one madvise call,
  one thread.
- vLLM 0.33 per rank, TP t: the path vLLM 0.33's CPUOffloadingSpec.create_worker takes in
  production (rank = worker, a barrier across t processes, num_segments=32) on --directory:
  each rank populates its own cells row by row, starting on different files; timed from the
  common start to the last rank's return.

The goals: the agent on huge pages >= 2.5x vLLM's populate on the node's /dev/shm (issue 35;
what a vLLM user has today), and the agent on 4 KiB pages >= 2x (issue 13). Which vLLM method
is "its populate": per rank is what a vLLM 0.33 engine runs, rank None is vLLM's method for a
whole region from one process (what the agent does); both are shown and the ratios are against
the faster one. Times cover create + populate (the files' creation is microseconds); the
agent's mlock is not counted (vLLM does not lock). The huge-page row also says how much of the
region its mapping holds in huge pages (smaps), so a fragmented host shows as such.

Geometry: Llama-3.1-70B at TP 4 (1,310,720-byte cells, 5 MiB rows; bench/region_common.py);
at 64 GiB every file is whole huge pages. vLLM's code comes from .vllm-src/ or an installed
vLLM 0.33 (bench/vllm_modules.py). Mounting the huge-page tmpfs needs root.

    source .gpu/env.sh && python3 bench/populate/run.py [--gib 64] [--tp 4]
        [--threads N ...] [--directory /dev/shm] [--huge-directory DIR | --no-huge]
        [--repeat 3] [--vllm-src .vllm-src]
    python bench/populate/run.py --quick     # CPU box: 2 GiB, one run
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.common.pages import (  # noqa: E402
    describe_root,
    free_page_reporting,
    has_huge_pages,
    huge_root,
)
from bench.region_common import (  # noqa: E402
    Geometry,
    add_region_options,
    open_vllm_region,
    run_ranks,
    show_as_dev_shm,
    vllm_source,
)

from bench import vllm_modules  # noqa: E402
from kvshm.region import SharedOffloadRegion, memory  # noqa: E402
from kvshm.region.populate import default_threads  # noqa: E402

POPULATE_TP = 4  # the geometry every method populates: Llama-3.1-70B's cells at TP 4


def kvshm_agent(
    rank: int,
    start: Barrier,
    barrier: Barrier,
    results: Any,
    instance_id: str,
    geometry: Geometry,
    directory: str,
    threads: int,
) -> None:
    start.wait()
    started = time.monotonic()
    region = SharedOffloadRegion(
        instance_id,
        geometry.kvshm_layout(),
        directory=directory,
        mode="create",
        populate=True,
        populate_threads=threads,
    )
    ready = time.monotonic()
    complete = region.is_fully_allocated()
    huge = memory.huge_mapped_bytes(region.address, geometry.size_bytes)
    region.cleanup()
    results.put(
        {"rank": rank, "start": started, "ready": ready, "complete": complete, "huge": huge}
    )


def vllm_populate(
    rank: int,
    start: Barrier,
    barrier: Barrier,
    results: Any,
    vllm_root: str | None,
    engine_id: str,
    geometry: Geometry,
    directory: str,
    per_rank: bool,
) -> None:
    show_as_dev_shm(directory)
    vllm = vllm_modules.load(Path(vllm_root) if vllm_root else None)
    start.wait()
    started = time.monotonic()
    region = open_vllm_region(
        vllm, engine_id, geometry, rank if per_rank else None, barrier if per_rank else None
    )
    ready = time.monotonic()
    complete = True
    if not per_rank:  # the files are still there (no barrier, no unlink): check every page
        paths = [path for path, _, _ in region._segments]
        complete = sum(os.stat(path).st_blocks * 512 for path in paths) >= geometry.size_bytes
    region.cleanup()
    results.put({"rank": rank, "start": started, "ready": ready, "complete": complete})


HUGE_SHARE: dict[str, float] = {}  # method -> share of its region mapped with huge pages


def timed(ranks: list[dict[str, Any]], name: str = "", size: int = 0) -> float:
    if not all(rank["complete"] for rank in ranks):
        raise SystemExit("a populated region was not fully allocated")
    if "huge" in ranks[0] and size:
        HUGE_SHARE[name] = ranks[0]["huge"] / size
    return float(max(rank["ready"] for rank in ranks) - min(rank["start"] for rank in ranks))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, help="region size (default 64)")
    parser.add_argument("--tp", type=int, nargs="+", help="vLLM per-rank runs (default 4)")
    parser.add_argument("--threads", type=int, nargs="+", help="kvshm threads (default: agent's)")
    parser.add_argument("--repeat", type=int, help="runs per method; median shown (default 3)")
    add_region_options(parser)
    huge = parser.add_mutually_exclusive_group()
    huge.add_argument(
        "--huge-directory", help="a tmpfs with huge pages (default: one mounted for the run)"
    )
    huge.add_argument("--no-huge", action="store_true", help="no huge-page rows")
    parser.add_argument("--quick", action="store_true", help="CPU check: 2 GiB, one run")
    args = parser.parse_args()
    gib = args.gib or (2.0 if args.quick else 64.0)
    repeat = args.repeat or (1 if args.quick else 3)
    vllm_root, description = vllm_source(args)
    geometry = Geometry.for_size(gib, POPULATE_TP)
    with contextlib.ExitStack() as stack:
        huge_dir = (
            None
            if args.no_huge
            else stack.enter_context(huge_root(geometry.size_bytes, args.huge_directory))
        )
        compare(args, geometry, repeat, vllm_root, description, huge_dir)


def compare(
    args: argparse.Namespace,
    geometry: Geometry,
    repeat: int,
    vllm_root: str | None,
    description: str,
    huge_dir: str | None,
) -> None:
    size = geometry.size_bytes
    base = f"kvshm-bench-populate-{os.getpid()}"
    small = "4 KiB pages" if not has_huge_pages(args.directory) else "huge pages"
    roots = [(args.directory, small), *([(huge_dir, "2 MiB pages")] if huge_dir else [])]
    methods: dict[str, Any] = {}
    for threads in args.threads or [default_threads()]:
        default = ", agent default" if threads == default_threads() else ""
        for directory, pages in roots:
            name = f"kvshm agent, {pages}, {threads} thr{default}"
            methods[name] = lambda t=threads, d=directory, n=name: timed(
                run_ranks(kvshm_agent, 1, base, geometry, d, t), n, size
            )
    methods["vLLM 0.33, rank None (1 call)"] = lambda: timed(
        run_ranks(vllm_populate, 1, vllm_root, base, geometry, args.directory, False)
    )
    for tp in args.tp or [4]:
        per_rank = geometry.split(tp)
        methods[f"vLLM 0.33 per rank, TP {tp}"] = lambda g=per_rank, t=tp: timed(
            run_ranks(vllm_populate, t, vllm_root, base, g, args.directory, True)
        )

    print(f"{description}; median of {repeat}")
    print(f"populate {geometry.describe()}")
    tail = geometry.kvshm_layout().huge_page_tail_bytes(memory.HUGE_PAGE_SIZE)
    print(f"  files not whole huge pages: {tail} bytes at their ends")
    for directory, _ in roots:
        print(f"  root {describe_root(directory)}")
    reporting = free_page_reporting()
    if reporting:
        print(f"  NOTE: {reporting}")
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeat):  # interleaved, so a drifting machine hurts every method alike
        for name, method in methods.items():
            samples[name].append(method())
    medians = {name: statistics.median(values) for name, values in samples.items()}
    vllm_best = min(seconds for name, seconds in medians.items() if name.startswith("vLLM"))
    print(
        f"  {'method':<46}{'seconds':>9}{'GB/s':>8}{'GiB/s':>8}{'vs best vLLM':>14}"
        f"{'huge-mapped':>13}"
    )
    for name, seconds in medians.items():
        share = f"{HUGE_SHARE[name]:>12.0%}" if name in HUGE_SHARE else f"{'-':>12}"
        print(
            f"  {name:<46}{seconds:>9.3f}{size / seconds / 1e9:>8.2f}"
            f"{size / seconds / 2**30:>8.2f}{vllm_best / seconds:>13.2f}x {share}"
        )
    agent = {pages: medians[name] for name in medians for _, pages in roots if pages in name}
    if small in agent:
        print(
            f"  goal (issue 13): kvshm agent on {small} >= 2x vLLM's populate: "
            f"{vllm_best / agent[small]:.2f}x"
        )
    if "2 MiB pages" in agent:
        ratio = vllm_best / agent["2 MiB pages"]
        print(
            f"  goal (issue 35): kvshm agent on 2 MiB pages >= 2.5x vLLM's populate on "
            f"{args.directory}: {ratio:.2f}x ({'met' if ratio >= 2.5 else 'NOT met'}); "
            f"2 MiB against {small}: {agent[small] / agent['2 MiB pages']:.2f}x"
        )


if __name__ == "__main__":
    main()
