"""GB/s of kvshm's transfer handlers against the link's peak and vLLM's one call per job.

For 16 KiB .. 2 MiB blocks, both directions, random block ids on both sides over a 1 GiB
populated, registered 4-worker region (this process is rank 0, two tensors per worker):
  (a) a 1 GiB contiguous pinned copy: the link's peak, one way and both ways at once;
  (b) vLLM's method: one cuMemcpyBatchAsync per job for all of its copies (kvshm's DMA backend
      with no chunking, so the same planner and, for stores, its address-sorted order);
  (c) kvshm's handler end to end: pointer math, backend choice, issue, completion; built by
      the plugin's own factory (HandlerLayout.handler), as the plugin's assembly builds a
      worker's handlers where nothing was measured or forced (the choice per job by block
      size).
Each timing of (b) and (c) moves 1 GiB, as (a) does: 64 MiB jobs over all of rank 0's rows,
swept four times with fresh random ids (--pass-mib 256 times a single sweep: a burst).
Also both directions at once, the CPU time transfer_async takes per block, and which backend
moved the jobs (from the kvshm_transfer_jobs_total metric); then the same for a many-layer
layout (--layers tensors per worker), where the staged backend applies; then, at 16 and 64 KiB,
how much (b) and (c) slow bf16 matrix products running beside them (a serving engine's compute).

Goals (docs/benchmarks.md): (c) >= 95% of (a) one way; both ways >= 80% of (a) below 256 KiB
and >= 90% from 256 KiB.

Run on a GPU machine from the repository root:
    source .gpu/env.sh && python3 bench/transfer/bench_transfer.py
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench.common.gpu import (  # noqa: E402
    GIB,
    KIB,
    MIB,
    Compute,
    beside_compute,
    gbps,
    link_peak,
    median_seconds,
    wall,
)
from prometheus_client import REGISTRY  # noqa: E402

from kvshm.region import RegionLayout, SharedOffloadRegion  # noqa: E402
from kvshm.transfer import (  # noqa: E402
    CanonicalKVCacheRef,
    CPULoadStoreSpec,
    Direction,
    GPULoadStoreSpec,
    HandlerLayout,
    SingleDirectionOffloadingHandler,
    TransferOptions,
)

BLOCK_SIZES = [16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 2 * MIB]
REGION_BYTES = GIB
WORKERS = 4
TENSORS = 2  # per worker: the goals' layout (a K and a V page per block)
JOB_BYTES = 64 * MIB
DIRECTIONS = ("H2D", "D2H")
BACKENDS = ("dma", "kernel", "staged")
# the blocks timed beside matrix products: where the copy kernel or staging is chosen
BESIDE_COMPUTE = {"two": (16 * KIB, 64 * KIB), "layers": (16 * KIB,)}
# (b): vLLM issues all of a job's copies in one cuMemcpyBatchAsync (no job has this many)
VLLM_ONE_CALL: dict[str, Any] = {
    "backend": "dma",
    "options": TransferOptions(descriptors_per_call=2**31 - 1),
}

Specs = list[tuple[Any, Any]]


@dataclass
class Setup:
    """Rank 0's rows of a populated region, moved as 64 MiB jobs with random ids on both
    sides, as many sweeps over them (with fresh ids) as make the bytes of one timing."""

    block: int
    creator: SharedOffloadRegion
    region: SharedOffloadRegion
    views: HandlerLayout
    stores: Specs
    loads: Specs
    copies_per_pass: int

    @property
    def pass_bytes(self) -> int:
        return self.copies_per_pass * self.block

    def specs(self, direction: str) -> Specs:
        return self.stores if direction == "D2H" else self.loads

    def handler(self, direction: str, **kwargs: Any) -> SingleDirectionOffloadingHandler:
        """A fresh handler over rank 0's views, as the plugin's assembly builds one (backend=,
        options= as the handler takes)."""
        return self.views.handler(direction == "D2H", **kwargs)

    def close(self) -> None:
        self.region.cleanup()
        self.creator.cleanup()


def make_setup(
    block: int, directory: str, rng: np.random.Generator, tensors: int, pass_bytes: int
) -> Setup:
    rows = REGION_BYTES // (WORKERS * tensors * block)
    instance = f"bench-{uuid.uuid4().hex[:12]}"
    layout = RegionLayout(rows, tensors * block, WORKERS)
    # the creator (rank None) populates the whole region; rank 0 attaches and registers it all
    creator = SharedOffloadRegion(instance, layout, directory=directory)
    region = SharedOffloadRegion(instance, layout, 0, directory=directory, populate=False)
    if not region.pin():
        sys.exit("could not register the region with CUDA: the figures would be meaningless")
    gpu = [
        torch.randint(-128, 128, (rows, block), dtype=torch.int8, device="cuda")
        for _ in range(tensors)
    ]
    refs = [[CanonicalKVCacheRef(t, block) for t in range(tensors)]]
    views = HandlerLayout.over_region(gpu, region, 1, refs)
    per_job = max(1, JOB_BYTES // (tensors * block))
    sweeps = max(1, pass_bytes // (rows * tensors * block))
    stores, loads = [], []
    for _ in range(sweeps):
        gpu_ids, cpu_ids = rng.permutation(rows), rng.permutation(rows)
        for start in range(0, rows, per_job):
            g, c = gpu_ids[start : start + per_job], cpu_ids[start : start + per_job]
            gpu_spec = GPULoadStoreSpec(g, [len(g)], [0])
            stores.append((gpu_spec, CPULoadStoreSpec(c)))
            loads.append((CPULoadStoreSpec(c), gpu_spec))
    return Setup(block, creator, region, views, stores, loads, sweeps * rows * tensors)


def jobs_by_backend(handlers: Sequence[SingleDirectionOffloadingHandler]) -> dict[str, float]:
    """kvshm_transfer_jobs_total per backend name, over the handlers' directions."""
    counts: dict[str, float] = {}
    for handler in handlers:
        direction: Direction = handler.direction
        for name in handler.backends:
            labels = {"direction": direction.value, "backend": name}
            value = REGISTRY.get_sample_value("kvshm_transfer_jobs_total", labels) or 0.0
            counts[name] = counts.get(name, 0.0) + value
    return counts


class HandlerRun:
    """Times passes of the handlers' jobs end to end (issued interleaved, one job per handler
    in turn), the CPU time transfer_async takes, and which backends moved the jobs."""

    def __init__(
        self, handlers: Sequence[SingleDirectionOffloadingHandler], specs: Sequence[Specs]
    ) -> None:
        self.handlers = handlers
        self.specs = specs
        self.next_id = 0
        self.issue_seconds: list[float] = []
        self._jobs_before = jobs_by_backend(handlers)

    def __call__(self) -> float:
        ids: list[list[int]] = [[] for _ in self.handlers]
        issue = 0.0

        def submit() -> None:
            nonlocal issue
            for jobs in zip(*self.specs, strict=True):
                for k, (handler, spec) in enumerate(zip(self.handlers, jobs, strict=True)):
                    started = time.perf_counter()
                    ok = handler.transfer_async(self.next_id, *spec)
                    issue += time.perf_counter() - started
                    assert ok, "a transfer failed to launch"
                    ids[k].append(self.next_id)
                    self.next_id += 1
            for handler, job_ids in zip(self.handlers, ids, strict=True):
                handler.wait(job_ids)

        seconds = wall(submit)
        for handler, job_ids in zip(self.handlers, ids, strict=True):
            results = handler.get_finished()
            assert [r.job_id for r in results] == job_ids and all(r.success for r in results)
        self.issue_seconds.append(issue)
        return seconds

    def backends_used(self) -> str:
        after = jobs_by_backend(self.handlers)
        used = [name for name, count in after.items() if count > self._jobs_before.get(name, 0)]
        return "+".join(sorted(used))

    def close(self) -> None:
        for handler in self.handlers:
            handler.shutdown()


def handler_gbps(setup: Setup, direction: str, reps: int, **kwargs: Any) -> dict[str, Any]:
    """GB/s one way, CPU µs per block in transfer_async, and the backends that moved the jobs."""
    run = HandlerRun([setup.handler(direction, **kwargs)], [setup.specs(direction)])
    seconds = median_seconds(run, reps)
    run.close()
    issue = statistics.median(run.issue_seconds[2:] or run.issue_seconds)  # past the warm-up
    return {
        "GB/s": gbps(setup.pass_bytes, seconds),
        "cpu_us_per_block": issue / setup.copies_per_pass * 1e6,
        "backend": run.backends_used(),
    }


def both_directions_gbps(setup: Setup, reps: int) -> float:
    """Stores of the first half of the jobs and loads of the second half, issued interleaved."""
    half = len(setup.stores) // 2 or 1
    handlers = [setup.handler("D2H"), setup.handler("H2D")]
    run = HandlerRun(handlers, [setup.stores[:half], setup.loads[-half:]])
    seconds = median_seconds(run, reps)
    run.close()
    return gbps(2 * half * setup.pass_bytes // len(setup.stores), seconds)


def submit_and_wait(handler: SingleDirectionOffloadingHandler, specs: Specs) -> Callable[[], None]:
    """Each call submits every spec as a job with a fresh id and waits for all of them
    (without synchronizing the device first, unlike wall(): the products run meanwhile)."""
    ids = iter(range(10**9))

    def run() -> None:
        jobs = [next(ids) for _ in specs]
        for job, spec in zip(jobs, specs, strict=True):
            handler.transfer_async(job, *spec)
        handler.wait(jobs)
        assert all(r.success for r in handler.get_finished())

    return run


def beside_rows(setup: Setup, compute: Compute, reps: int, label: str) -> list[dict[str, Any]]:
    """(c) and (b), each beside the matrix products."""
    out = []
    for direction in DIRECTIONS:
        row: dict[str, Any] = {"layout": label, "block": setup.block, "dir": direction}
        for name, kwargs in (("kvshm", {}), ("vllm", VLLM_ONE_CALL)):
            handler = setup.handler(direction, **kwargs)
            issue = submit_and_wait(handler, setup.specs(direction))
            beside = beside_compute(compute, setup.pass_bytes, issue, reps)
            row[name], row[f"{name}_slowdown"] = beside.GBps, beside.slowdown
            row[f"{name}_delay_ms_per_gb"] = beside.delay_ms_per_gb
            handler.shutdown()
        out.append(row)
    return out


def measure_layout(
    args: argparse.Namespace,
    setup: Setup,
    peak: dict[str, float],
    forced: bool,
) -> list[dict[str, Any]]:
    """(b) and (c) each way, both ways at once, and with forced=True each backend alone."""
    rows = []
    for direction in DIRECTIONS:
        ours = handler_gbps(setup, direction, args.reps)
        theirs = handler_gbps(setup, direction, args.reps, **VLLM_ONE_CALL)
        row = {"block": setup.block, "dir": direction, "peak": peak[direction]}
        row |= {"vllm": theirs["GB/s"], "kvshm": ours["GB/s"], "backend": ours["backend"]}
        row["cpu_us_per_block"] = ours["cpu_us_per_block"]
        for name in BACKENDS if forced else ():
            row[name] = handler_gbps(setup, direction, args.reps, backend=name)["GB/s"]
        rows.append(row)
    rate = both_directions_gbps(setup, args.reps)
    rows.append({"block": setup.block, "dir": "both", "peak": peak["both"], "kvshm": rate})
    return rows


def kib(nbytes: int) -> str:
    return f"{nbytes // KIB} KiB"


def table(header: Sequence[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def transfer_table(rows: list[dict[str, Any]], forced: bool) -> None:
    def cell(row: dict[str, Any], key: str, form: str = "{:.1f}") -> str:
        return form.format(row[key]) if key in row else ""

    header = ["block", "dir", "(a) peak", "(b) vLLM 1 call", "(c) kvshm", "c/a", "c/b"]
    header += ["backend", "CPU µs/block in transfer_async"] + (list(BACKENDS) if forced else [])
    lines = []
    for r in rows:
        line = [kib(r["block"]), r["dir"], cell(r, "peak"), cell(r, "vllm"), cell(r, "kvshm")]
        line += [f"{r['kvshm'] / r['peak']:.0%}"]
        line += [f"{r['kvshm'] / r['vllm']:.2f}x" if "vllm" in r else ""]
        line += [r.get("backend", "auto"), cell(r, "cpu_us_per_block", "{:.2f}")]
        line += [cell(r, name) for name in BACKENDS] if forced else []
        lines.append(line)
    table(header, lines)


def beside_table(rows: list[dict[str, Any]]) -> None:
    header = ["layout", "page", "dir", "(c) kvshm GB/s", "products take"]
    header += ["(b) vLLM 1 call GB/s", "products take"]
    lines = []
    for r in rows:
        line = [r["layout"], kib(r["block"]), r["dir"], f"{r['kvshm']:.1f}"]
        line += [f"{r['kvshm_slowdown']:.2f}x", f"{r['vllm']:.1f}", f"{r['vllm_slowdown']:.2f}x"]
        lines.append(line)
    table(header, lines)


def goals(rows: list[dict[str, Any]]) -> dict[str, bool]:
    one_way = [r for r in rows if r["dir"] != "both"]
    both = [r for r in rows if r["dir"] == "both"]
    return {
        "(c) >= 95% of (a), every size and direction": all(
            r["kvshm"] >= 0.95 * r["peak"] for r in one_way
        ),
        "both ways >= 80% of (a) below 256 KiB, >= 90% from 256 KiB": all(
            r["kvshm"] >= (0.8 if r["block"] < 256 * KIB else 0.9) * r["peak"] for r in both
        ),
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default="/dev/shm", help="where to create the region")
    parser.add_argument("--reps", type=int, default=7, help="timings per figure (median)")
    parser.add_argument(
        "--pass-mib", type=int, default=1024, help="MiB each timing moves (256: a burst)"
    )
    parser.add_argument(
        "--sizes", default=",".join(str(b // KIB) for b in BLOCK_SIZES), help="block sizes, KiB"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=32,
        help="tensors per worker in the many-layers layout (one per layer; 0 skips it)",
    )
    parser.add_argument("--layer-pages", default="16,64", help="its page sizes in KiB")
    parser.add_argument("--json", help="write all figures to this file")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    device = torch.cuda.get_device_name()
    print(f"device: {device}; torch {torch.__version__} (CUDA {torch.version.cuda})")
    peak = link_peak(args.reps)
    print(f"(a) link peak, 1 GiB pinned, GB/s: { {k: round(v, 1) for k, v in peak.items()} }")
    rng = np.random.default_rng(0)
    compute = Compute()
    results: dict[str, list[dict[str, Any]]] = {"two": [], "layers": [], "beside": []}
    cases = [(int(k) * KIB, TENSORS, "two") for k in args.sizes.split(",")]
    if args.layers > 0:
        cases += [(int(k) * KIB, args.layers, "layers") for k in args.layer_pages.split(",")]
    for block, tensors, key in cases:
        setup = make_setup(block, args.dir, rng, tensors, args.pass_mib * MIB)
        try:
            results[key] += measure_layout(args, setup, peak, forced=key == "layers")
            if block in BESIDE_COMPUTE[key]:
                label = f"{tensors} tensors"
                results["beside"] += beside_rows(setup, compute, args.reps, label)
        finally:
            setup.close()

    print(f"\n{device}: GB/s, 1 GiB registered 4-worker region, random ids, 64 MiB jobs")
    print(f"{TENSORS} tensors per worker (the goals' layout)")
    transfer_table(results["two"], forced=False)
    if results["layers"]:
        print(f"\n{args.layers} tensors per worker (a block's pages form one run of the region)")
        transfer_table(results["layers"], forced=True)
    print("\nbeside compute: bf16 4096x4096 products queued first, about as long as the transfer")
    beside_table(results["beside"])
    met = goals(results["two"])
    for goal, ok in met.items():
        print(f"goal {goal}: {'met' if ok else 'NOT met'}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"device": device, "peak": peak, "goals": met} | results, out, indent=1)


if __name__ == "__main__":
    main()
