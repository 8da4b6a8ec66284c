"""Engine start-up: how long a serving engine waits on its CPU offload region, vLLM 0.33's own
way vs attaching the region the kvshm agent made beforehand.

Each (size, TP) runs TP rank processes as vLLM runs its tensor-parallel workers, three ways:

1. vLLM 0.33 creator: no region exists. Each rank calls vLLM's own `SharedOffloadRegion(
   engine_id, num_chunks, rank, kv_bytes_per_chunk, cpu_page_size, barrier, num_segments=32)`
   exactly as `CPUOffloadingSpec.create_worker` does (barrier: a multiprocessing.Barrier across
   the ranks): one creates the 32 files, all map them, the creator unlinks them at the barrier,
   and each populates its own cells row by row, starting on different files. Then each
   registers the region with CUDA with vLLM's own `pin_mmap_region(region,
   worker_slot_only=True)`, as `CPUOffloadingWorker` does (for these layouts: each row's cell
   of this rank, one cudaHostRegister each).
2. vLLM 0.33 joiner of the agent's region: the same calls while the agent's files exist, so vLLM
   joins them (the production path with the agent and an unmodified vLLM): no create, no unlink,
   but each rank still runs its populate loop over its cells.
3. kvshm attach of the agent's region: kvshm's `SharedOffloadRegion(id, layout, rank,
   mode="attach")`, no populate (the agent's pages are all there), then `pin()` (the whole
   region, row-aligned pieces of at most 64 GiB, in every rank). At TP > 1 also a second run
   registering only the rank's cells as the plugin's worker does (`pin(cells_only=True)`: the
   cells' pages mapped in parallel, then one cudaHostRegister per row's cell, as vLLM registers
   its slots).

The agent's region is made beforehand by a separate process with kvshm's `SharedOffloadRegion`
(create, populate, lock: what the agent's hosting does), format vllm-0.33 (the files vLLM 0.33
names and maps), and removed before the creator runs: at most one region exists at a time.

Timed per rank from a common start (after imports and CUDA context creation; CLOCK_MONOTONIC is
one clock for all processes), reported as the slowest rank:
- open -> ready: the constructor returned (mapped, populated): what the engine waits for if it
  registers in the background.
- register: the registration call alone (run in a background thread while the main thread
  ticks every 1 ms: `stall` is the longest tick, i.e. whether registration blocks the engine's
  other start-up work). The first transfer may start only after it (`transfer-ready`).
- blocking, inline: open -> ready + register, what vLLM 0.33 blocks for (it registers inline
  in CPUOffloadingWorker.__init__).
The goal (issue 13): vLLM's creator inline >= 8x kvshm attach with background registration at
TP 4. TP 4 here is four processes on one GPU (a real engine has one GPU per rank).

vLLM's code is loaded by bench/vllm_modules.py (its docstring says what is vLLM's and what is
plumbing) from .vllm-src/ (scripts/extract-vllm-bench-src.sh) or an installed vLLM 0.33.

With --compare-pages (issue 35) it runs kvshm's paths only, on 4 KiB pages (--directory, the
node's /dev/shm) against 2 MiB huge pages (a tmpfs mounted huge=within_size for the run, root
needed, or --huge-directory), interleaved per repeat: how much faster the agent's region on
huge pages registers, whole and (TP > 1) the rank's cells. Goal: cells >= 1.5x at TP 4.

    source .gpu/env.sh && python3 bench/attach/run.py
        [--gib 16 64] [--tp 1 4]
        [--directory /dev/shm] [--repeat 1] [--vllm-src .vllm-src] [--json out.json]
        [--compare-pages [--huge-directory DIR]]
    python bench/attach/run.py --quick     # 2 GiB; on a CPU box without registration
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.attach.report import PathTimes, median_times, print_pages, print_table  # noqa: E402
from bench.common.pages import describe_root, huge_root  # noqa: E402
from bench.region_common import (  # noqa: E402
    AgentRegion,
    Geometry,
    add_region_options,
    open_vllm_region,
    run_ranks,
    show_as_dev_shm,
    vllm_source,
)

from bench import vllm_modules  # noqa: E402
from kvshm.region import SharedOffloadRegion  # noqa: E402

TICK_S = 0.001
WARM_UP_BYTES = 2 * 1024 * 1024


# -- in each rank process ------------------------------------------------------------------


def prepare_cuda(register: bool, warm_up: Callable[[int, int], None]) -> None:
    """Create this process's CUDA context and register/unregister a small buffer once, so
    neither the context nor the driver's first registration is timed: in an engine both
    happened long before its offload worker is built."""
    if not register:
        return
    import ctypes
    import mmap

    import torch

    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda")
    buffer = mmap.mmap(-1, WARM_UP_BYTES)
    anchor = ctypes.c_char.from_buffer(buffer)
    warm_up(ctypes.addressof(anchor), WARM_UP_BYTES)
    del anchor
    buffer.close()


def register_in_background(pin: Callable[[], bool]) -> dict[str, Any]:
    """Run pin() in a thread while this thread ticks every TICK_S, as an engine going on with
    its start-up would; return when it started and ended and the longest tick."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        outcome["reg_start"] = time.monotonic()
        try:
            outcome["pinned"] = bool(pin())
        except Exception as exc:  # reported by the parent, with the rank
            outcome["pinned"], outcome["reg_error"] = False, repr(exc)
        outcome["reg_end"] = time.monotonic()

    thread = threading.Thread(target=run, name="register")
    thread.start()
    stall = 0.0
    while thread.is_alive():
        tick = time.monotonic()
        time.sleep(TICK_S)
        stall = max(stall, time.monotonic() - tick)
    thread.join()
    outcome["stall"] = stall
    return outcome


def vllm_rank(
    rank: int,
    start: Barrier,
    barrier: Barrier,
    results: Any,
    vllm_root: str | None,
    engine_id: str,
    geometry: Geometry,
    directory: str,
    register: bool,
) -> None:
    show_as_dev_shm(directory)
    vllm = vllm_modules.load(Path(vllm_root) if vllm_root else None)
    host_register = vllm.host_register

    def warm_up(address: int, length: int) -> None:
        assert host_register.host_register(address, length), "vLLM's host_register failed"
        host_register.host_unregister(address)

    prepare_cuda(register, warm_up)
    start.wait()
    started = time.monotonic()
    region = open_vllm_region(vllm, engine_id, geometry, rank, barrier)
    ready = time.monotonic()
    result = {"rank": rank, "start": started, "ready": ready, "joined": maps_named_file(region)}
    if register:
        result |= register_in_background(
            lambda: vllm.pin_mmap_region(region, worker_slot_only=True) or region.is_pinned
        )
    results.put(result)
    region.cleanup()


def maps_named_file(region: Any) -> bool:
    """Whether vLLM's region maps the file its name still names: true for a joiner of the
    agent's region, false for vLLM's own (its creator unlinks the files at the barrier)."""
    try:
        return os.stat(region.mmap_path).st_ino == os.fstat(region.fd).st_ino
    except FileNotFoundError:
        return False


def kvshm_rank(
    rank: int,
    start: Barrier,
    barrier: Barrier,
    results: Any,
    instance_id: str,
    geometry: Geometry,
    directory: str,
    register: bool,
    cells_only: bool,
) -> None:
    from kvshm.region.pinning import CudaRegistration, cuda_runtime

    def warm_up(address: int, length: int) -> None:
        cudart, reason = cuda_runtime()
        assert cudart is not None, reason
        registration = CudaRegistration(cudart, address, [(0, length)])
        registration.register()
        registration.unregister()

    prepare_cuda(register, warm_up)
    start.wait()
    started = time.monotonic()
    region = SharedOffloadRegion(
        instance_id, geometry.kvshm_layout(), rank, directory=directory, mode="attach"
    )
    ready = time.monotonic()
    assert region.populate_method is None, "attaching the agent's region should not populate"
    result = {"rank": rank, "start": started, "ready": ready}
    if register:
        result |= register_in_background(
            (lambda: region.pin(cells_only=True)) if cells_only else region.pin
        )
    results.put(result)
    region.cleanup()


# -- in the parent -------------------------------------------------------------------------


def files_present(directory: str, geometry: Geometry, instance_id: str) -> list[str]:
    names = [file.name for file in geometry.kvshm_layout().files(instance_id)]
    return [name for name in names if os.path.exists(os.path.join(directory, name))]


def kvshm_paths(
    tp: int, agent_id: str, geometry: Geometry, directory: str, register: bool
) -> dict[str, PathTimes]:
    """kvshm's attach of the agent's region, registering the whole region and (at TP > 1,
    with CUDA) the rank's cells."""
    times = {
        "kvshm_attach": PathTimes.of(
            run_ranks(kvshm_rank, tp, agent_id, geometry, directory, register, False)
        )
    }
    if tp > 1 and register:
        times["kvshm_cells"] = PathTimes.of(
            run_ranks(kvshm_rank, tp, agent_id, geometry, directory, register, True)
        )
    return times


def run_once(
    gib: float, tp: int, directory: str, vllm_root: str | None, register: bool
) -> tuple[dict[str, PathTimes], dict[str, Any]]:
    geometry = Geometry.for_size(gib, tp)
    agent_id = f"kvshm-bench-agent-{os.getpid()}-{tp}"
    own_id = f"kvshm-bench-vllm-{os.getpid()}-{tp}"
    agent = AgentRegion(agent_id, geometry, directory)
    try:
        times = kvshm_paths(tp, agent_id, geometry, directory, register)
        joiner = run_ranks(vllm_rank, tp, vllm_root, agent_id, geometry, directory, register)
        if not all(rank["joined"] for rank in joiner):
            raise SystemExit("vLLM did not join the agent's region (did it see the directory?)")
        times["vllm_joiner"] = PathTimes.of(joiner)
        kept = files_present(directory, geometry, agent_id)
        if len(kept) != geometry.kvshm_layout().file_count:
            raise SystemExit(f"vLLM's joiner removed agent files: only {kept} are left")
    finally:
        agent.close()  # the agent's region is gone before vLLM makes its own
    creator = run_ranks(vllm_rank, tp, vllm_root, own_id, geometry, directory, register)
    if any(rank["joined"] for rank in creator):
        raise SystemExit("vLLM's creator did not unlink its files at the barrier")
    times["vllm_creator"] = PathTimes.of(creator)
    left = files_present(directory, geometry, own_id)
    if left:
        raise SystemExit(f"vLLM's creator left {left} behind")
    return times, agent.report


def run_kvshm(
    gib: float, tp: int, directory: str, register: bool
) -> tuple[dict[str, PathTimes], dict[str, Any]]:
    """kvshm's paths alone on `directory` (--compare-pages): those huge pages change."""
    geometry = Geometry.for_size(gib, tp)
    agent_id = f"kvshm-bench-agent-{os.getpid()}-{tp}"
    agent = AgentRegion(agent_id, geometry, directory)
    try:
        times = kvshm_paths(tp, agent_id, geometry, directory, register)
    finally:
        agent.close()
    return times, agent.report


def compare_pages(args: argparse.Namespace, register: bool) -> None:
    """--compare-pages: kvshm's attach and registration on 4 KiB pages (--directory) against
    2 MiB ones (a huge-page tmpfs), interleaved, for every size and TP."""
    report: list[dict[str, Any]] = []
    sizes, tps = args.gib or ([2.0] if args.quick else [16.0, 64.0]), args.tp or [1, 4]
    largest = max(Geometry.for_size(gib, tp).size_bytes for gib in sizes for tp in tps)
    with huge_root(largest, args.huge_directory) as huge_dir:
        roots = {"4 KiB": args.directory, "2 MiB": huge_dir}
        for name, directory in roots.items():
            print(f"{name} pages: {describe_root(directory)}")
        for gib in sizes:
            for tp in tps:
                runs: dict[str, list[dict[str, PathTimes]]] = {name: [] for name in roots}
                agents: dict[str, dict[str, Any]] = {}
                for repeat in range(args.repeat):
                    # alternate which root goes first, so neither always runs on a warmer host
                    order = list(roots.items())[:: 1 if repeat % 2 == 0 else -1]
                    for name, directory in order:
                        times, agents[name] = run_kvshm(gib, tp, directory, register)
                        runs[name].append(times)
                medians = {
                    name: {path: median_times([r[path] for r in each]) for path in each[0]}
                    for name, each in runs.items()
                }
                print_pages(gib, tp, medians, agents)
                report.append(
                    {
                        "gib": gib,
                        "tp": tp,
                        "agents": agents,
                        **{
                            f"{name}:{path}": asdict(value)
                            for name, paths in medians.items()
                            for path, value in paths.items()
                        },
                    }
                )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, nargs="+", help="region sizes (default 16 64)")
    parser.add_argument("--tp", type=int, nargs="+", help="tensor-parallel sizes (default 1 4)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per case; medians shown")
    add_region_options(parser)
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument(
        "--compare-pages",
        action="store_true",
        help="kvshm's attach and registration on 4 KiB pages (--directory) against 2 MiB ones "
        "(issue 35), instead of the comparison with vLLM",
    )
    parser.add_argument(
        "--huge-directory",
        help="with --compare-pages: a tmpfs with huge pages (default: one mounted for the run)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small check: 2 GiB, TP 1 and 4 (runs without CUDA, then without registration)",
    )
    args = parser.parse_args()
    import torch

    register = torch.cuda.is_available()
    if not register and not args.quick:
        raise SystemExit("no CUDA device: registration is part of this benchmark; use --quick")
    sizes = args.gib or ([2.0] if args.quick else [16.0, 64.0])
    tps = args.tp or [1, 4]
    vllm_root, description = vllm_source(args)
    device = torch.cuda.get_device_name() if register else "no CUDA"
    print(f"{description}; {device}; median of {args.repeat}")
    if not register:
        print(
            "NOTE: no CUDA device, so no registration: 'register', 'inline' and 'xfer-ready' "
            "are not measured and the ratios compare open->ready only"
        )
    if args.compare_pages:
        compare_pages(args, register)
        return
    report: list[dict[str, Any]] = []
    for gib in sizes:
        for tp in tps:
            runs = [
                run_once(gib, tp, args.directory, vllm_root, register) for _ in range(args.repeat)
            ]
            times = {path: median_times([run[path] for run, _ in runs]) for path in runs[0][0]}
            print_table(gib, tp, times, runs[-1][1])
            report.append(
                {
                    "gib": gib,
                    "tp": tp,
                    "geometry": asdict(Geometry.for_size(gib, tp)),
                    "agent": runs[-1][1],
                    **{path: asdict(value) for path, value in times.items()},
                }
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
