"""GB/s of the kvshm vLLM plugin's worker against the link and vLLM 0.33's own worker, on the
KV layouts vLLM 0.33 builds for real models (issue 14):
  Llama-3.1-8B TP1 (32 layers, 32 KiB K/V pages), Qwen2.5-7B TP1 (28 layers, 16 KiB),
  Llama-3.1-70B TP4 rank 0 (80 layers, 8 KiB; a 4-worker region), and 2 MiB blocks;
  then the three models with a block-outer KV cache (VLLM_KV_CACHE_LAYOUT=BLHNC: one page of
  every layer a block, as vLLM's connector worker hands it to the spec).
For each: H2D (loads), D2H (stores) and both at once, jobs of --job-blocks blocks with random
block ids on both sides, every GPU block once per pass (about --gib GiB per direction), the
median of three rounds over the directions, each the median of --reps passes:
  (a) the link: one way the best of one 1 GiB pinned copy and 8 MiB pieces in a row; both ways
      the best of a pair of 1 GiB copies and 8 / 32 MiB pieces interleaved on two streams;
  (b) vLLM 0.33's own CPUOffloadingWorker from the installed wheel (its handlers, its Triton
      kernel for small-page loads; its DMA call, a C++ op, re-stated with the same single
      cuMemcpyBatchAsync when vllm._C cannot load here: the output says which);
  (c) kvshm's plugin worker (kvshm.vllm.worker) end to end on an agent-made region;
and beside (b) and (c), bf16 4096x4096 matrix products sized to outlast the transfer: how many
times as long they take, and the milliseconds they lose per GB moved (the goal's measure: the
factor depends on how long the products are). Also what building each
worker blocks, the plugin's background CUDA registration, and how long its first transfer waited.

Then engine start at TP 4 (rank 0) on a 64 GiB region (--start-gib): what vLLM's own worker
blocks against the plugin's, the plugin's background registration and its first store's wait.

Run on a GPU machine from the repository root, vLLM 0.33.0's wheel installed with --no-deps and
the few pure-Python packages its worker modules import (docs/vllm-plugin.md):
    source .gpu/env.sh && python3 bench/vllm_plugin/run.py
        [--layouts a,b] [--json FILE]
Exits non-zero if anything could not be measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench.common.gpu import (  # noqa: E402
    GIB,
    MIB,
    Compute,
    beside_compute,
    gbps,
    link_peak,
    median_seconds,
    python_loop_ms,
    wall,
)
from bench.vllm_plugin.baseline import Built, build_vllm, vllm_dma_note, vllm_platform_note  # noqa: E402
from bench.vllm_plugin.jobs import Plan, issue_and_wait, job_specs, plan  # noqa: E402
from tests.vllm_plugin.layouts import (  # noqa: E402
    BLOCK_OUTER_LAYOUTS,
    REAL_LAYOUTS,
    KvLayout,
    canonical_kv_caches,
)
from tests.vllm_plugin.regions import agent_region, remove_region  # noqa: E402

from kvshm.transfer.choice.chooser import BACKEND_NAMES, COPY_ENGINES  # noqa: E402
from kvshm.vllm.attach import attach_region  # noqa: E402
from kvshm.vllm.geometry import RegionGeometry  # noqa: E402
from kvshm.vllm.worker import KvshmOffloadingWorker  # noqa: E402

SHM = "/dev/shm"
DIRECTIONS = ("H2D", "D2H", "both")
problems: list[str] = []


def problem(message: str) -> None:
    problems.append(message)
    print(f"!! {message}", flush=True)


# -- (a) the link ------------------------------------------------------------------------------


def pieces(piece: int, reps: int, ways: tuple[str, ...]) -> float:
    """GB/s of 1 GiB per way ("H2D", "D2H") in `piece`-byte copies, a stream per way, the
    ways' copies issued in turn."""
    host = [torch.empty(GIB, dtype=torch.uint8, pin_memory=True) for _ in ways]
    device = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in ways]
    for buffer in host:
        buffer.fill_(7)
    streams = [torch.cuda.Stream() for _ in ways]

    def issue() -> None:
        for start in range(0, GIB, piece):
            for way, stream, cpu, gpu in zip(ways, streams, host, device, strict=True):
                source, target = (cpu, gpu) if way == "H2D" else (gpu, cpu)
                with torch.cuda.stream(stream):
                    target[start : start + piece].copy_(source[start : start + piece], True)

    return gbps(len(ways) * GIB, median_seconds(lambda: wall(issue), reps, warmup=1))


def link(reps: int) -> dict[str, Any]:
    """Each way's ceiling is the best of several methods: one method alone has read a host's
    link 10-20 % low in a run (a pair of 1 GiB copies both ways, one 1 GiB D2H copy once)."""
    one = link_peak(reps)
    methods: dict[str, dict[str, float]] = {
        way: {"1 GiB copy": one[way], "8 MiB pieces in a row": pieces(8 * MIB, reps, (way,))}
        for way in ("H2D", "D2H")
    }
    methods["both"] = {
        "pair of 1 GiB copies": one["both"],
        "8 MiB pieces interleaved on two streams": pieces(8 * MIB, reps, ("H2D", "D2H")),
        "32 MiB pieces interleaved on two streams": pieces(32 * MIB, reps, ("H2D", "D2H")),
    }
    peak: dict[str, Any] = {}
    for way, measured in methods.items():
        best = max(measured, key=lambda k: measured[k])
        peak[way] = measured[best]
        peak[f"{way}_methods"] = measured
        peak[f"{way}_best"] = best
    return peak


CALIBRATE: list[Any] = []  # (c)'s ChoiceCache (fresh per run): the plugin measures by default
PLUGIN_BACKEND: list[str] = []  # (c)'s kvshm_backend, where --backend names one


def build_plugin(kv: Any, chunks: int, cell: int, workers: int, directory: str = SHM) -> Built:
    instance_id = f"kvshm-bench-plugin-{uuid.uuid4().hex[:8]}"
    agent_region(directory, instance_id, chunks, cell, workers)  # the agent's work, beforehand
    started = time.perf_counter()
    geometry = RegionGeometry(chunks, cell * workers, cell, workers, False)
    region = attach_region(directory, instance_id, geometry, 0, 5.0)
    worker = KvshmOffloadingWorker(
        kv,
        region,
        1,
        region_dir=directory,
        instance_id=instance_id,
        listen_for_drain=False,
        backend=PLUGIN_BACKEND[0] if PLUGIN_BACKEND else None,
        calibration=CALIBRATE[0] if CALIBRATE else None,
    )
    seconds = time.perf_counter() - started

    def close() -> None:
        worker.shutdown()
        remove_region(directory, instance_id)  # every file: a 64 GiB region has 32

    return Built(worker, seconds, close, {})


ROUNDS = 3
"""Rounds over the directions per worker; each figure is the median of its rounds' medians.
A lent host's link dips for seconds at a time (one of seven passes at 44 GB/s where the rest
moved 52.7, docs/transfer.md F31): spread over the run, a dip lands on one round."""


def measure(
    built: Built, jobs: Plan, compute: Compute, reps: int, beside_reps: int
) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    rounds: dict[str, list[float]] = {d: [] for d in DIRECTIONS}
    submitting: dict[str, list[float]] = {d: [] for d in DIRECTIONS}
    for direction in DIRECTIONS:
        stores, loads = jobs.jobs[direction]

        def run(
            stores: list[Any] = stores,
            loads: list[Any] = loads,
            into: list[float] = submitting[direction],
        ) -> None:
            into.append(issue_and_wait(built.worker, stores, loads))

        runs[direction] = run
        wall(run)  # warm-up
        submitting[direction].clear()
    for _ in range(ROUNDS):
        for direction in DIRECTIONS:
            seconds = statistics.median(wall(runs[direction]) for _ in range(reps))
            rounds[direction].append(gbps(jobs.nbytes[direction], seconds))
    out: dict[str, Any] = {}
    for direction in DIRECTIONS:
        stores, loads = jobs.jobs[direction]
        submit = statistics.median(submitting[direction]) / (len(stores) + len(loads))
        beside = beside_compute(compute, jobs.nbytes[direction], runs[direction], beside_reps)
        out[direction] = {
            "GBps": statistics.median(rounds[direction]),
            "GBps_rounds": rounds[direction],
            "GBps_beside": beside.GBps,
            "matmul_slowdown": beside.slowdown,
            "matmul_delay_ms_per_GB": beside.delay_ms_per_gb,
            "matmul_delay_quartiles": beside.delay_quartiles,
            "submit_us_per_job": submit * 1e6,
        }
    return out


def blocks_for(layout: KvLayout, gib: float, workers: int) -> int:
    return max(64, int(gib * GIB / layout.worker_bytes_per_block))


def bench_layout(layout: KvLayout, args: argparse.Namespace, compute: Compute) -> dict[str, Any]:
    workers = 4 if "tp4" in layout.name else 1
    blocks = blocks_for(layout, args.gib, workers)
    cell = layout.worker_bytes_per_block
    kv = canonical_kv_caches(layout, blocks, "cuda")
    jobs = plan(layout, blocks, args.job_blocks, seed=len(layout.name))
    row: dict[str, Any] = {
        "python_loop_ms": python_loop_ms(),
        "layout": layout.name,
        "blocks": blocks,
        "workers": workers,
        "region_bytes": blocks * cell * workers,
    }
    for name, build in (("vllm", build_vllm), ("plugin", build_plugin)):
        if name not in args.workers.split(","):
            continue
        try:
            built = build(kv, blocks, cell, workers)
        except Exception as exc:
            problem(f"{layout.name}: could not build the {name} worker: {exc!r}")
            continue
        try:
            row[f"{name}_blocking_s"] = built.blocking_seconds
            if name == "plugin":
                first = time.perf_counter()
                issue_and_wait(built.worker, jobs.jobs["D2H"][0][:1], [])
                row["plugin_first_transfer_s"] = time.perf_counter() - first
                row["plugin_first_transfer_waited_s"] = built.worker.first_transfer_wait_seconds
                pin = built.worker.pin
                row["plugin_registration_s"] = pin.pin_seconds if pin else None
                row["plugin_pinned"] = bool(pin and pin.pinned)
                row["plugin_backends"] = built.worker.handler_backends()
                row["plugin_calibrated"] = built.worker.chosen_backends
                row["plugin_calibration_s"] = built.worker.calibration_seconds
            else:
                row["vllm_pinned"] = built.notes["pinned"]
            row[name] = measure(built, jobs, compute, args.reps, args.beside_reps)
        except Exception as exc:
            problem(f"{layout.name}: measuring the {name} worker failed: {exc!r}")
        finally:
            built.close()
    del kv
    torch.cuda.empty_cache()
    return row


def bench_start(gib: float) -> dict[str, Any]:
    """Engine start at TP 4 on a region of about `gib` GiB, as rank 0: what building vLLM's own
    worker (its region: create, populate its cells, register) blocks, against the plugin's
    attach (registration in the background), and how long the plugin's first store waited."""
    layout = REAL_LAYOUTS[2]  # Llama-3.1-70B TP4 rank 0
    workers, cell = 4, layout.worker_bytes_per_block
    chunks = int(gib * GIB // (cell * workers))
    kv = canonical_kv_caches(layout, 64, "cuda")
    row: dict[str, Any] = {"region_bytes": chunks * cell * workers}
    for name, build in (("vllm", build_vllm), ("plugin", build_plugin)):
        built = build(kv, chunks, cell, workers)
        try:
            row[f"{name}_blocking_s"] = built.blocking_seconds
            if name == "plugin":
                job = job_specs(np.arange(16), np.arange(16), 16)
                first = time.perf_counter()
                issue_and_wait(built.worker, job, [])
                row["plugin_first_store_s"] = time.perf_counter() - first
                row["plugin_first_transfer_waited_s"] = built.worker.first_transfer_wait_seconds
                row["plugin_registration_s"] = built.worker.pin.pin_seconds
                row["plugin_calibration_s"] = built.worker.calibration_seconds
        finally:
            built.close()
    row["blocking_ratio"] = row["vllm_blocking_s"] / row["plugin_blocking_s"]
    print(
        f"\n== start, TP 4 rank 0, region {row['region_bytes'] / GIB:.1f} GiB: vLLM's own "
        f"worker blocked {row['vllm_blocking_s']:.2f}s; "
        f"the plugin's {row['plugin_blocking_s']:.3f}s "
        f"({row['blocking_ratio']:.0f}x less), registration {row['plugin_registration_s']:.2f}s "
        f"in the background; its first store took {row['plugin_first_store_s']:.2f}s, of which "
        f"{row['plugin_first_transfer_waited_s']:.2f}s waiting for the registration (started "
        f"at once here: in an engine, model loading runs meanwhile) and "
        f"{row.get('plugin_calibration_s') or 0:.2f}s measuring the copy backends (once per host "
        f"and layout)"
    )
    return row


# -- output ------------------------------------------------------------------------------------


def delay(figures: dict[str, Any] | None) -> str:
    """The products' delay per GB beside a transfer: median (quartiles)."""
    if not figures:
        return "-"
    first, third = figures["matmul_delay_quartiles"]
    return f"{figures['matmul_delay_ms_per_GB']:.2f} ({first:.1f}..{third:.1f})"


def print_layout(row: dict[str, Any], peak: dict[str, Any]) -> None:
    print(
        f"\n== {row['layout']}: {row['blocks']} blocks, region {row['region_bytes'] / GIB:.1f} "
        f"GiB ({row['workers']} worker cells per row)"
    )
    print(
        f"{'':6} {'(a) link':>9} {'(b) vLLM':>9} {'(c) kvshm':>9} {'c/a':>6} {'c/b':>6} "
        f"{'matmul x beside b':>18} {'beside c':>9} {'ms/GB beside b':>21} {'beside c':>21}"
    )
    for d in DIRECTIONS:
        b = row.get("vllm", {}).get(d)
        c = row.get("plugin", {}).get(d)
        a = peak[d]

        def f(x: float | None, w: int = 9, p: int = 1) -> str:
            return f"{x:>{w}.{p}f}" if x is not None else f"{'-':>{w}}"

        print(
            f"{d:6} {f(a)} {f(b and b['GBps'])} {f(c and c['GBps'])} "
            f"{f(c and c['GBps'] / a, 6, 2)} {f(c and b and c['GBps'] / b['GBps'], 6, 2)} "
            f"{f(b and b['matmul_slowdown'], 18, 2)} {f(c and c['matmul_slowdown'], 9, 2)} "
            f"{delay(b):>21} {delay(c):>21}"
        )
    if "plugin_blocking_s" in row:
        print(
            f"start: plugin create_worker blocked {row['plugin_blocking_s']:.3f}s "
            f"(registration {row.get('plugin_registration_s') or 0:.3f}s in the background, "
            f"pinned={row.get('plugin_pinned')}; first transfer took "
            f"{row.get('plugin_first_transfer_s', 0):.3f}s of which waiting for it "
            f"{row.get('plugin_first_transfer_waited_s') or 0:.3f}s); vLLM's own blocked "
            f"{row.get('vllm_blocking_s', float('nan')):.3f}s (pinned={row.get('vllm_pinned')})"
        )
    for name, label in (("vllm", "(b)"), ("plugin", "(c)")):
        if name in row:
            each = [f"{d} {row[name][d]['submit_us_per_job']:.0f}" for d in DIRECTIONS]
            per_round = [
                f"{d} " + "/".join(f"{x:.1f}" for x in row[name][d]["GBps_rounds"])
                for d in DIRECTIONS
            ]
            print(f"{label} GB/s per round: {' · '.join(per_round)}")
            print(f"{label} submitting, us a job: {' / '.join(each)}")
    print(
        f"a fixed Python loop took {row['python_loop_ms']:.1f} ms before this layout (about 10 "
        f"on a core of its own on the lent hosts, up to 20 on a shared one)"
    )
    if "plugin_backends" in row:
        print(f"plugin backends: {row['plugin_backends']}")
    if row.get("plugin_calibrated"):
        print(
            f"plugin backends chosen by measurement: {row['plugin_calibrated']} (measured in "
            f"{row.get('plugin_calibration_s') or 0:.2f}s of the first transfer)"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", help="comma-separated names (default: all)")
    parser.add_argument("--gib", type=float, default=2.0, help="GPU KV per layout, GiB")
    parser.add_argument("--job-blocks", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--beside-reps",
        type=int,
        default=9,
        help="pairs of products alone and beside per figure (the GPU's clock wanders: more "
        "pairs, a steadier median)",
    )
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument(
        "--workers", default="vllm,plugin", help="which of (b) vllm and (c) plugin to measure"
    )
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="(c) chooses its backends by block size instead of measuring them at its first "
        "transfer (the plugin's default, kvshm_calibrate, with a fresh cache here)",
    )
    parser.add_argument(
        "--backend",
        default="auto",
        choices=("auto", COPY_ENGINES, *BACKEND_NAMES),
        help="(c)'s kvshm_backend: auto (measured among all), copy-engines (among those that "
        "use no SMs) or one backend by name",
    )
    parser.add_argument(
        "--start-gib", type=float, default=64.0, help="region for the start-up figure (0: skip)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/vllm_plugin/run.py needs a CUDA device")
    every = (*REAL_LAYOUTS, *BLOCK_OUTER_LAYOUTS)
    layouts = [x for x in every if not args.layouts or x.name in args.layouts.split(",")]
    if not layouts:
        sys.exit(f"no layout matches {args.layouts!r}: {[x.name for x in every]}")
    print(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}")
    if args.backend != "auto":
        PLUGIN_BACKEND.append(args.backend)
    if not args.no_calibrate:
        from kvshm.transfer.calibration import ChoiceCache

        CALIBRATE.append(ChoiceCache(Path(tempfile.mkdtemp(prefix="kvshm-bench-choices-"))))
        logging.basicConfig(format="%(message)s")
        logging.getLogger("kvshm.transfer.calibration").setLevel(logging.INFO)
    import vllm

    print(f"vLLM {vllm.__version__} from {Path(vllm.__file__).parent}")
    print(f"(b) platform: {vllm_platform_note()}")
    dma = vllm_dma_note()
    print(f"(b) DMA: {dma}")
    peak = link(args.reps)
    print("(a) link GB/s, each way the best of its methods:")
    for way in DIRECTIONS:
        methods = ", ".join(f"{k} {v:.1f}" for k, v in peak[f"{way}_methods"].items())
        print(f"  {way:5} {peak[way]:.1f} ({methods})")
    compute = Compute()
    rows = []
    for layout in layouts:
        row = bench_layout(layout, args, compute)
        print_layout(row, peak)
        rows.append(row)
    start = bench_start(args.start_gib) if args.start_gib > 0 else None
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "link": peak,
                    "vllm_dma": dma,
                    "layouts": rows,
                    "start": start,
                    "problems": problems,
                },
                indent=2,
                default=str,
            )
        )
    if problems:
        print(f"\n{len(problems)} problem(s):", *problems, sep="\n  ")
        sys.exit(1)


if __name__ == "__main__":
    main()
