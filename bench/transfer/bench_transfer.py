"""GB/s of kvshm's transfer handlers against the link peak and vLLM's one-call method.

For 16 KiB .. 2 MiB blocks, both directions, random block ids on both sides over a 1 GiB
populated, registered 4-worker region (this process is rank 0, two tensors per worker):
  (a) a 1 GiB contiguous pinned copy: the link's peak, one way and both ways at once;
  (b) vLLM's method: one cuMemcpyBatchAsync per job for all of its copies;
  (c) kvshm's handler end to end: pointer math, backend choice, issue, completion.
Each timing of (b) and (c) moves 1 GiB, as (a) does: 64 MiB jobs over all of rank 0's rows,
swept four times with fresh random ids (--pass-mib 256 times a single sweep, a burst from an
idle GPU in which the first job's planning weighs four times as much).
Also both directions at once through the handlers, and the CPU cost of issuing a block; then
the same for a many-layer layout (--layers tensors per worker, default 32), where each block's
pages form one run of the region and the staged backend applies; then, at 16 and 64 KiB, how
much kvshm's copies and vLLM's slow matrix products running beside them (a serving engine's
compute), and how fast each copies meanwhile.

Run on a GPU machine from the repository root:
    PYTHONPATH=agent:operator python3 bench/transfer/bench_transfer.py [--sweep] [--json FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvshm.region import RegionLayout, SharedOffloadRegion
from kvshm.transfer import (
    CanonicalKVCacheRef,
    CpuGpuOffloadingHandlers,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    SingleDirectionOffloadingHandler,
    TransferOptions,
)
from kvshm.transfer.backends.cuda_driver import CopyDirection, cuda_driver
from kvshm.transfer.options import DEFAULT_KERNEL_CHUNK_BYTES

KIB, MIB, GIB = 1024, 1024**2, 1024**3
BLOCK_SIZES = [16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 2 * MIB]
REGION_BYTES = GIB
WORKERS = 4
TENSORS = 2
JOB_BYTES = 64 * MIB
PASS_BYTES = GIB  # each timing moves as much as (a)'s one copy
BURST_BYTES = 256 * MIB  # one sweep of rank 0's rows: what the experiment scripts time
DIRECTIONS = ("H2D", "D2H")


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def median_seconds(run: Callable[[], float], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        run()
    return statistics.median(run() for _ in range(reps))


def wall(issue: Callable[[], None]) -> float:
    """Seconds from an idle GPU to the end of everything `issue` queued."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    issue()
    torch.cuda.synchronize()
    return time.perf_counter() - started


# -- (a) the link ------------------------------------------------------------------------------


def link_peak(reps: int) -> dict[str, float]:
    host = [torch.empty(GIB, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    for buffer in host:  # never time zeros
        buffer.view(torch.int64).copy_(torch.arange(GIB // 8, dtype=torch.int64))
    device = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]

    def h2d() -> None:
        with torch.cuda.stream(streams[0]):
            device[0].copy_(host[0], non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(streams[1]):
            host[1].copy_(device[1], non_blocking=True)

    def both() -> None:
        h2d()
        d2h()

    result = {
        "H2D": gbps(GIB, median_seconds(lambda: wall(h2d), reps)),
        "D2H": gbps(GIB, median_seconds(lambda: wall(d2h), reps)),
        "both": gbps(2 * GIB, median_seconds(lambda: wall(both), reps)),
    }
    return result


# -- the region and the jobs -------------------------------------------------------------------


@dataclass
class Setup:
    block: int
    creator: SharedOffloadRegion
    region: SharedOffloadRegion
    pair: CpuGpuOffloadingHandlers
    stores: list[tuple[Any, Any]]
    loads: list[tuple[Any, Any]]
    copies_per_pass: int

    @property
    def pass_bytes(self) -> int:
        return self.copies_per_pass * self.block

    def close(self) -> None:
        self.pair.shutdown()
        self.region.cleanup()
        self.creator.cleanup()


def make_setup(
    block: int,
    directory: str,
    rng: np.random.Generator,
    tensors: int = TENSORS,
    pass_bytes: int = PASS_BYTES,
    evenly_spaced: bool = False,
) -> Setup:
    """Rank 0's rows of the region moved as 64 MiB jobs with random ids on both sides, as
    many sweeps over them (with fresh ids) as make pass_bytes."""
    rows = REGION_BYTES // (WORKERS * tensors * block)
    instance = f"bench-{uuid.uuid4().hex[:12]}"
    layout = RegionLayout(rows, tensors * block, WORKERS)
    # the creator (rank None) populates the whole region; rank 0 attaches and registers it all
    creator = SharedOffloadRegion(instance, layout, directory=directory)
    region = SharedOffloadRegion(instance, layout, 0, directory=directory, populate=False)
    if not region.pin():
        sys.exit("could not register the region with CUDA: the figures would be meaningless")
    if evenly_spaced:  # one allocation, so tensor t+1 starts a fixed distance after tensor t
        whole = torch.randint(-128, 128, (tensors, rows, block), dtype=torch.int8, device="cuda")
        gpu = list(whole.unbind(0))
    else:
        gpu = [
            torch.randint(-128, 128, (rows, block), dtype=torch.int8, device="cuda")
            for _ in range(tensors)
        ]
    refs = [[CanonicalKVCacheRef(t, block) for t in range(tensors)]]
    pair = CpuGpuOffloadingHandlers(gpu, region, 1, refs, pin=False)
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
    return Setup(block, creator, region, pair, stores, loads, sweeps * rows * tensors)


def handler_for(setup: Setup, direction: str, **kwargs: Any) -> SingleDirectionOffloadingHandler:
    pair = setup.pair
    return SingleDirectionOffloadingHandler(
        pair.gpu_tensors,
        pair.cpu_tensors,
        1,
        pair.gpu_to_cpu_handler.kv_cache_groups_data_refs,
        gpu_to_cpu=direction == "D2H",
        **kwargs,
    )


def specs_for(setup: Setup, direction: str) -> list[tuple[Any, Any]]:
    return setup.stores if direction == "D2H" else setup.loads


# -- (b) vLLM's method -------------------------------------------------------------------------


def one_call_issue(setup: Setup, direction: str, synchronize: bool = False) -> Callable[[], None]:
    """vLLM's method with the descriptors precomputed: one cuMemcpyBatchAsync per job."""
    handler = handler_for(setup, direction, backend="dma")
    batches = [handler._planner.plan(spec) for spec in specs_for(setup, direction)]
    handler.shutdown()
    driver = cuda_driver()
    attributes = CopyDirection(direction == "D2H", torch.cuda.current_device()).attributes()
    stream = torch.cuda.Stream()

    def issue() -> None:
        for batch in batches:
            rows = batch.rows
            code = driver.memcpy_batch(
                rows[1].ctypes.data,
                rows[0].ctypes.data,
                rows[2].ctypes.data,
                batch.count,
                attributes,
                stream.cuda_stream,
            )
            driver.check("cuMemcpyBatchAsync", code)
        if synchronize:
            stream.synchronize()

    return issue


def one_call_per_job(setup: Setup, direction: str, reps: int) -> float:
    issue = one_call_issue(setup, direction)
    return gbps(setup.pass_bytes, median_seconds(lambda: wall(issue), reps))


# -- (c) the handlers --------------------------------------------------------------------------


class IssueTimer:
    """Wraps a handler's backends to add up the time their copy() calls take (the driver
    calls and kernel launches, part of the time transfer_async takes)."""

    def __init__(self, handler: SingleDirectionOffloadingHandler) -> None:
        self.seconds = 0.0
        backends = handler._chooser._backends
        for name, backend in list(backends.items()):
            backends[name] = self._timed(backend)

    def _timed(self, backend: Any) -> Any:
        timer = self
        original = backend.copy

        def copy(batch: Any, stream: Any, after: Any = None) -> object:
            started = time.perf_counter()
            try:
                return original(batch, stream, after)
            finally:
                timer.seconds += time.perf_counter() - started

        backend.copy = copy
        return backend


class HandlerRun:
    """Times passes of a handler's jobs end to end, and the CPU time spent issuing them:
    in transfer_async, and the part of it spent in the backends."""

    def __init__(
        self, handlers: Sequence[SingleDirectionOffloadingHandler], specs: Sequence[Sequence[Any]]
    ) -> None:
        self.handlers = handlers
        self.specs = specs
        self.next_id = 0
        self.issue_seconds: list[float] = []
        self.timers = [IssueTimer(handler) for handler in handlers]
        self.backend_seconds: list[float] = []

    def __call__(self) -> float:
        ids: list[list[int]] = [[] for _ in self.handlers]
        issue = 0.0

        def submit() -> None:
            nonlocal issue
            for jobs in zip(*self.specs, strict=True):
                for k, (handler, spec) in enumerate(zip(self.handlers, jobs, strict=True)):
                    started = time.perf_counter()
                    ok = handler.transfer_async(self.next_id, spec)
                    issue += time.perf_counter() - started
                    assert ok, "a transfer failed to launch"
                    ids[k].append(self.next_id)
                    self.next_id += 1
            for handler, job_ids in zip(self.handlers, ids, strict=True):
                handler.wait(job_ids)

        before = sum(timer.seconds for timer in self.timers)
        seconds = wall(submit)
        self.backend_seconds.append(sum(timer.seconds for timer in self.timers) - before)
        for handler, job_ids in zip(self.handlers, ids, strict=True):
            results = handler.get_finished()
            assert [r.job_id for r in results] == job_ids and all(r.success for r in results)
        self.issue_seconds.append(issue)
        return seconds


def handler_gbps(
    setup: Setup, direction: str, reps: int, **kwargs: Any
) -> tuple[float, float, float]:
    """(GB/s, CPU µs per block in transfer_async, of those µs in the backends)."""
    handler = handler_for(setup, direction, **kwargs)
    run = HandlerRun([handler], [specs_for(setup, direction)])
    seconds = median_seconds(run, reps)
    handler.shutdown()
    caller = statistics.median(run.issue_seconds[2:] or run.issue_seconds)
    backend = statistics.median(run.backend_seconds[2:] or run.backend_seconds)
    per_block = 1e6 / setup.copies_per_pass
    return gbps(setup.pass_bytes, seconds), caller * per_block, backend * per_block


def both_directions_gbps(setup: Setup, reps: int, **kwargs: Any) -> float:
    """Stores of the first half of the jobs and loads of the second half, issued interleaved."""
    half = len(setup.stores) // 2 or 1
    stores, loads = setup.stores[:half], setup.loads[-half:]
    store, load = handler_for(setup, "D2H", **kwargs), handler_for(setup, "H2D", **kwargs)
    run = HandlerRun([store, load], [stores, loads])
    seconds = median_seconds(run, reps)
    store.shutdown()
    load.shutdown()
    return gbps(2 * half * setup.pass_bytes // len(setup.stores), seconds)


# -- beside compute: what the copies cost a serving engine's matrix products ------------------


class Compute:
    """bf16 4096 x 4096 matrix products on their own stream, standing in for decode steps."""

    def __init__(self) -> None:
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.stream = torch.cuda.Stream()
        self.ms_each = self.run(50) / 50

    def start(self, count: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            for _ in range(count):
                torch.mm(self.a, self.a)
            end.record(self.stream)
        return start, end

    def run(self, count: int) -> float:
        start, end = self.start(count)
        end.synchronize()
        return float(start.elapsed_time(end))


def beside_compute(
    compute: Compute, nbytes: int, issue_and_wait: Callable[[], None], reps: int
) -> tuple[float, float]:
    """(GB/s of the transfer, how many times as long the products take) with products of
    about the transfer's length queued first on their own stream."""
    count = max(1, round(nbytes / 50e9 * 1e3 / compute.ms_each))
    alone = statistics.median(compute.run(count) for _ in range(reps))
    rates, slowed = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start, end = compute.start(count)
        started = time.perf_counter()
        issue_and_wait()
        rates.append(gbps(nbytes, time.perf_counter() - started))
        end.synchronize()
        slowed.append(start.elapsed_time(end) / alone)
    return statistics.median(rates), statistics.median(slowed)


def submit_and_wait(
    handler: SingleDirectionOffloadingHandler, specs: Sequence[Any]
) -> Callable[[], None]:
    """Each call submits every spec as a job with a fresh id and waits for all of them
    (without synchronizing the device first, unlike wall())."""
    ids = iter(range(10**9))

    def run() -> None:
        jobs = [next(ids) for _ in specs]
        for job, spec in zip(jobs, specs, strict=True):
            handler.transfer_async(job, spec)
        handler.wait(jobs)
        assert all(r.success for r in handler.get_finished())

    return run


def compute_rows(setup: Setup, compute: Compute, reps: int, label: str) -> list[dict[str, Any]]:
    """kvshm's handler and vLLM's one call per job, each beside the products."""
    out = []
    for direction in DIRECTIONS:
        handler = handler_for(setup, direction)
        specs = specs_for(setup, direction)
        ours = beside_compute(compute, setup.pass_bytes, submit_and_wait(handler, specs), reps)
        backend = chosen_backend(setup, direction)
        handler.shutdown()
        theirs = beside_compute(
            compute, setup.pass_bytes, one_call_issue(setup, direction, synchronize=True), reps
        )
        out.append(
            {"layout": label, "block": setup.block, "dir": direction, "backend": backend}
            | {"kvshm": ours[0], "kvshm_slowdown": ours[1]}
            | {"vllm": theirs[0], "vllm_slowdown": theirs[1]}
        )
    return out


COMPUTE_HEADER = [
    "layout",
    "page",
    "dir",
    "kvshm GB/s",
    "products take",
    "backend",
    "vLLM 1 call GB/s",
    "products take",
]


def compute_row(r: dict[str, Any]) -> list[str]:
    return [
        r["layout"],
        kib(r["block"]),
        r["dir"],
        f"{r['kvshm']:.1f}",
        f"{r['kvshm_slowdown']:.2f}x",
        r["backend"],
        f"{r['vllm']:.1f}",
        f"{r['vllm_slowdown']:.2f}x",
    ]


# -- what the policy would choose, and sweeps --------------------------------------------------


def chosen_backend(setup: Setup, direction: str) -> str:
    handler = handler_for(setup, direction)
    batch = handler._planner.plan(specs_for(setup, direction)[0])
    name = handler._chooser.choose(batch).name
    handler.shutdown()
    return name


def sweep(setup: Setup, reps: int) -> list[dict[str, Any]]:
    """Each backend forced, one way and both ways at once."""
    rows = []
    per_job = TransferOptions(stream_per_job=True)
    for direction in DIRECTIONS:
        for variant, kwargs in [
            ("dma", {"backend": "dma"}),
            ("kernel", {"backend": "kernel"}),
            ("staged", {"backend": "staged"}),
            ("auto, stream per job", {"options": per_job}),
        ]:
            rate, caller, issue = handler_gbps(setup, direction, reps, **kwargs)
            rows.append(
                {"block": setup.block, "dir": direction, "variant": variant, "GB/s": rate}
                | {"caller_us": caller, "backend_us": issue}
            )
    rate = both_directions_gbps(setup, reps, options=per_job)
    rows.append(
        {"block": setup.block, "dir": "both", "variant": "auto, stream per job", "GB/s": rate}
        | {"caller_us": 0.0, "backend_us": 0.0}
    )
    backends = ("dma", "kernel", "staged")
    for store_backend, load_backend in itertools.product(backends, backends):
        half = len(setup.stores) // 2 or 1
        store = handler_for(setup, "D2H", backend=store_backend)
        load = handler_for(setup, "H2D", backend=load_backend)
        run = HandlerRun([store, load], [setup.stores[:half], setup.loads[-half:]])
        seconds = median_seconds(run, reps)
        store.shutdown()
        load.shutdown()
        rate = gbps(2 * half * setup.pass_bytes // len(setup.stores), seconds)
        variant = f"D2H {store_backend} + H2D {load_backend}"
        rows.append(
            {"block": setup.block, "dir": "both", "variant": variant, "GB/s": rate}
            | {"caller_us": 0.0, "backend_us": 0.0}
        )
    return rows


# -- issue cost: ctypes against cuda-bindings ----------------------------------------------------


def issue_cost_comparison(count: int = 128, block: int = 16 * KIB) -> dict[str, Any]:
    """CPU microseconds per descriptor to issue one cuMemcpyBatchAsync of `count` copies."""
    src = torch.empty(count * block, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(count * block, dtype=torch.uint8, device="cuda")
    table = np.empty((3, count), dtype=np.uint64)
    table[0] = src.data_ptr() + np.arange(count, dtype=np.uint64) * block
    table[1] = dst.data_ptr() + np.arange(count, dtype=np.uint64) * block
    table[2] = block
    stream = torch.cuda.Stream()
    driver = cuda_driver()
    attributes = CopyDirection(False, torch.cuda.current_device()).attributes()
    out: dict[str, Any] = {}

    def time_calls(call: Callable[[], None]) -> float:
        """Steady state: 32 calls back to back while the copies run, then one sync."""
        call()
        stream.synchronize()
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(32):
                call()
            samples.append(time.perf_counter() - started)
            stream.synchronize()
        return statistics.median(samples) / (32 * count) * 1e6

    def by_ctypes() -> None:
        code = driver.memcpy_batch(
            table[1].ctypes.data,
            table[0].ctypes.data,
            table[2].ctypes.data,
            count,
            attributes,
            stream.cuda_stream,
        )
        driver.check("cuMemcpyBatchAsync", code)

    out["ctypes_us_per_descriptor"] = time_calls(by_ctypes)
    try:
        from cuda.bindings import driver as cu

        out["cuda_bindings_signature"] = (
            (cu.cuMemcpyBatchAsync.__doc__ or "").strip().splitlines()[0]
        )
        attr = cu.CUmemcpyAttributes()
        attr.srcAccessOrder = cu.CUmemcpySrcAccessOrder.CU_MEMCPY_SRC_ACCESS_ORDER_ANY
        attr.flags = 1
        handle = cu.CUstream(stream.cuda_stream)

        def by_bindings() -> None:
            dsts = [cu.CUdeviceptr(int(p)) for p in table[1]]
            srcs = [cu.CUdeviceptr(int(p)) for p in table[0]]
            sizes = [int(s) for s in table[2]]
            result = cu.cuMemcpyBatchAsync(dsts, srcs, sizes, count, [attr], [0], 1, handle)
            if int(result[0]) != 0:
                raise RuntimeError(f"cuda-bindings cuMemcpyBatchAsync returned {result}")

        out["cuda_bindings_us_per_descriptor"] = time_calls(by_bindings)
    except Exception as exc:  # report, do not hide: the comparison is part of the output
        out["cuda_bindings_error"] = f"{type(exc).__name__}: {exc}"
    return out


def kib(nbytes: int) -> str:
    return f"{nbytes // KIB} KiB"


def met(ok: bool) -> str:
    return "met" if ok else "NOT met"


ONE_WAY_HEADER = [
    "block",
    "dir",
    "(a) peak",
    "(b) vLLM 1 call",
    "(c) kvshm",
    "c/a",
    "c/b",
    "backend",
    "CPU µs/block in transfer_async (in driver/launch)",
]
BOTH_HEADER = ["block", "(a) bidirectional peak", "(c) kvshm both", "c/a"]


def one_way_row(r: dict[str, Any]) -> list[str]:
    return [
        kib(r["block"]),
        r["dir"],
        f"{r['peak']:.1f}",
        f"{r['vllm']:.1f}",
        f"{r['kvshm']:.1f}",
        f"{r['kvshm'] / r['peak']:.0%}",
        f"{r['kvshm'] / r['vllm']:.2f}x",
        r["backend"],
        f"{r['caller_us']:.2f} ({r['backend_us']:.2f})",
    ]


def both_row(r: dict[str, Any]) -> list[str]:
    return [
        kib(r["block"]),
        f"{r['peak']:.1f}",
        f"{r['kvshm']:.1f}",
        f"{r['kvshm'] / r['peak']:.0%}",
    ]


def table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


# -- many layers: the staged backend's case ----------------------------------------------------

LAYERS_HEADER = [
    "page",
    "dir",
    "(a) peak",
    "(b) vLLM 1 call",
    "(c) kvshm",
    "c/a",
    "backend",
    "kernel",
    "dma",
    "staged",
]


def many_layers(
    args: argparse.Namespace,
    peak: dict[str, float],
    rng: np.random.Generator,
    compute: Compute,
    beside: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    if args.layers <= 0:
        return []
    out: list[dict[str, Any]] = []
    for page in [int(k) * KIB for k in args.layer_pages.split(",")]:
        setup = make_setup(page, args.dir, rng, tensors=args.layers, pass_bytes=args.pass_mib * MIB)
        try:
            for direction in DIRECTIONS:
                row: dict[str, Any] = {"page": page, "dir": direction, "peak": peak[direction]}
                row["vllm"] = one_call_per_job(setup, direction, args.reps)
                row["kvshm"] = handler_gbps(setup, direction, args.reps)[0]
                row["backend"] = chosen_backend(setup, direction)
                for name in ("kernel", "dma", "staged"):
                    row[name] = handler_gbps(setup, direction, args.reps, backend=name)[0]
                out.append(row)
            rate = both_directions_gbps(setup, args.reps)
            out.append({"page": page, "dir": "both", "peak": peak["both"], "kvshm": rate})
            if page == 16 * KIB:
                beside += compute_rows(setup, compute, args.reps, f"{args.layers} tensors")
        finally:
            setup.close()
    return out


def layers_row(r: dict[str, Any]) -> list[str]:
    def cell(key: str) -> str:
        return f"{r[key]:.1f}" if key in r else ""

    return [
        kib(r["page"]),
        r["dir"],
        f"{r['peak']:.1f}",
        cell("vllm"),
        f"{r['kvshm']:.1f}",
        f"{r['kvshm'] / r['peak']:.0%}",
        r.get("backend", "auto"),
        cell("kernel"),
        cell("dma"),
        cell("staged"),
    ]


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dir", default="/dev/shm", help="where to create the region")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument(
        "--pass-mib",
        type=int,
        default=PASS_BYTES // MIB,
        help="bytes each timing moves, in MiB (256 = one sweep of rank 0's rows: a burst)",
    )
    parser.add_argument(
        "--sizes", default=",".join(str(b // KIB) for b in BLOCK_SIZES), help="block sizes in KiB"
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="also time each backend forced, one way and in every pairing both ways",
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=32,
        help="tensors per worker in the many-layers layout (one per layer; 0 skips it)",
    )
    parser.add_argument(
        "--layer-pages", default="16,64", help="page sizes in KiB for the many-layers layout"
    )
    parser.add_argument("--json", help="write all figures to this file")
    args = parser.parse_args()
    blocks = [int(k) * KIB for k in args.sizes.split(",")]

    driver = cuda_driver()
    device = torch.cuda.get_device_name()
    print(f"device: {device}; CUDA driver {driver.version}; torch {torch.__version__}")
    print(f"cuMemcpyBatchAsync found: {driver.has_batch}")
    peak = link_peak(args.reps)
    print(
        "(a) link peak, 1 GiB pinned, GB/s: "
        + json.dumps({k: round(v, 1) for k, v in peak.items()})
    )
    issue = issue_cost_comparison()
    print(f"issue cost per descriptor (128 x 16 KiB): {json.dumps(issue)}")

    rng = np.random.default_rng(0)
    compute = Compute()
    rows: list[dict[str, Any]] = []
    both: list[dict[str, Any]] = []
    beside: list[dict[str, Any]] = []
    sweeps: list[dict[str, Any]] = []
    for block in blocks:
        setup = make_setup(block, args.dir, rng, pass_bytes=args.pass_mib * MIB)
        try:
            for direction in DIRECTIONS:
                vllm = one_call_per_job(setup, direction, args.reps)
                kvshm, caller_us, backend_us = handler_gbps(setup, direction, args.reps)
                backend = chosen_backend(setup, direction)
                rows.append(
                    {"block": block, "dir": direction, "peak": peak[direction], "vllm": vllm}
                    | {"kvshm": kvshm, "backend": backend}
                    | {"caller_us": caller_us, "backend_us": backend_us}
                )
            rate = both_directions_gbps(setup, args.reps)
            both.append({"block": block, "peak": peak["both"], "kvshm": rate})
            if block in (16 * KIB, 64 * KIB):
                beside += compute_rows(setup, compute, args.reps, f"{TENSORS} tensors")
            if args.sweep:
                sweeps += sweep(setup, max(3, args.reps // 2))
        finally:
            setup.close()

    layers = many_layers(args, peak, rng, compute, beside)

    print(f"\n{device}: GB/s, 1 GiB registered 4-worker region, random ids, 64 MiB jobs")
    print(f"{TENSORS} tensors per worker (the goals' layout)")
    table(ONE_WAY_HEADER, [one_way_row(r) for r in rows])
    print("\nboth directions at once (stores and loads interleaved)")
    table(BOTH_HEADER, [both_row(r) for r in both])
    if layers:
        print(
            f"\nmany layers: {args.layers} tensors per worker, so each block's pages form one "
            "run of the region; kvshm (auto) against each backend forced"
        )
        table(LAYERS_HEADER, [layers_row(r) for r in layers])
    print(
        "\nbeside compute: bf16 4096x4096 products queued first on their own stream, about as "
        "long as the transfer; how many times as long they take beside it"
    )
    table(COMPUTE_HEADER, [compute_row(r) for r in beside])
    if sweeps:
        print("\nsweep (handler end to end, forced backend)")
        table(
            [
                "block",
                "dir",
                "variant",
                "GB/s",
                "CPU µs/block in transfer_async (in driver/launch)",
            ],
            [
                [
                    kib(r["block"]),
                    r["dir"],
                    r["variant"],
                    f"{r['GB/s']:.1f}",
                    f"{r['caller_us']:.2f} ({r['backend_us']:.2f})",
                ]
                for r in sweeps
            ],
        )
    one_way = all(r["kvshm"] >= 0.95 * r["peak"] for r in rows)
    two_way = all(r["kvshm"] >= (0.8 if r["block"] < 256 * KIB else 0.9) * r["peak"] for r in both)
    print(f"\ngoal (c) >= 95% of (a), every size and direction: {met(one_way)}")
    print(f"goal both ways >= 80% of peak below 256 KiB, >= 90% from 256 KiB: {met(two_way)}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "device": device,
                    "driver": driver.version,
                    "peak": peak,
                    "issue": issue,
                    "rows": rows,
                    "both": both,
                    "sweep": sweeps,
                    "layers": layers,
                    "beside_compute": beside,
                    "default_kernel_chunk": DEFAULT_KERNEL_CHUNK_BYTES,
                },
                out,
                indent=1,
            )


if __name__ == "__main__":
    main()
