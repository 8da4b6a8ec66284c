"""Round three of the transfer experiments (docs/transfer.md quotes them): what limits the
copy kernel both ways and the copy engines below 64 KiB, and what a staged copy would cost.

  persistent  a copy kernel with a bounded grid that loops over the copies, one way and both
              ways at once (is the ~52 GB/s both ways of two kernels a hardware cap, or two
              grids that cannot share the SMs?)
  contiguity  16 KiB DMA descriptors with the host side, the device side or both contiguous
              (is the engines' cap the driver's cost per descriptor, or scattered addresses?)
  gather      CPU gather/scatter of region blocks to/from a contiguous pinned buffer, by
              thread count (what a staged copy would cost the serving pod's cores)
  variants    the bounded kernel's cache hints, chunk sizes and uneven grids per direction
  hosttable   the kernel reading its table from pinned memory: alone, both ways, beside DMA,
              split with DMA, and on contiguous host memory

    PYTHONPATH=agent:operator python3 bench/transfer/explore_limits.py [--dir=D] [parts...]

and, for the layouts of 2 x 16 KiB, 2 x 64 KiB and 32 x 16 KiB pages per worker:

  layers      each backend (and kernel grids) steady over 16 jobs and beside a stream of
              matrix products: GB/s, and how much longer the products take
              [--staged: also where a staged job's time goes; --staged-only: that alone,
              with staging buffer sizes, 1 GiB per timing]

    PYTHONPATH=agent:operator python3 bench/transfer/explore_limits.py layers [--staged]
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import triton
import triton.language as tl
from bench_transfer import BURST_BYTES, KIB, Setup, gbps, make_setup, median_seconds, wall
from explore import attrs_for, batches, fixed, issue_dma, part

from kvshm.transfer.backends.kernel import KernelBackend
from kvshm.transfer.batch import CopyBatch

REPS = 5


@triton.jit
def copy_persistent_kernel(  # type: ignore[no-untyped-def]
    table_ptr,
    count,
    total,
    CHUNKS: tl.constexpr,
    CHUNK: tl.constexpr,
    LOAD_CACHE: tl.constexpr = "",
    STORE_CACHE: tl.constexpr = "",
    EVICT: tl.constexpr = "",
):
    """Like copy_blocks_kernel, but a bounded grid: program p moves chunks p, p+G, p+2G, ..."""
    for work in range(tl.program_id(0), total, tl.num_programs(0)):
        copy = work // CHUNKS
        start = (work % CHUNKS).to(tl.int64) * CHUNK
        size = tl.load(table_ptr + 2 * count + copy)
        src = (tl.load(table_ptr + copy) + start).to(tl.pointer_type(tl.int64))
        dst = (tl.load(table_ptr + count + copy) + start).to(tl.pointer_type(tl.int64))
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        words = tl.multiple_of((size - start) // 8, 2)
        offsets = tl.arange(0, CHUNK // 8)
        mask = offsets < words
        data = tl.load(src + offsets, mask=mask, cache_modifier=LOAD_CACHE, eviction_policy=EVICT)
        tl.store(dst + offsets, data, mask=mask, cache_modifier=STORE_CACHE, eviction_policy=EVICT)


def pinned(batch: CopyBatch) -> CopyBatch:
    out = CopyBatch.allocate(batch.count, pinned=True)
    out.rows[:] = batch.rows
    return out.with_total(batch.total_bytes)


def hosttable(setup: Setup) -> None:
    """The kernel with descriptors in host memory: alone, both ways, and beside DMA."""
    block = setup.block
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    jobs = {d: [pinned(b) for b in batches(setup, d)] for d in ("H2D", "D2H")}
    n = len(jobs["D2H"])
    half = n // 2 or 1
    streams = {"H2D": torch.cuda.Stream(), "D2H": torch.cuda.Stream()}
    dma_streams = {"H2D": torch.cuda.Stream(), "D2H": torch.cuda.Stream()}
    attrs = {d: attrs_for(d) for d in ("H2D", "D2H")}
    label = f"{block // KIB}K"

    # the library's kernel reads its table from pinned memory, as these experiments need
    kernels = {grid: KernelBackend(torch.device("cuda", 0), programs=grid) for grid in (sm, 2 * sm)}

    def kernel(d: str, b: CopyBatch, grid: int = 2 * sm) -> None:
        with torch.cuda.stream(streams[d]):
            if b.count:
                kernels[grid].launch(b.table, 0, b.count, block)

    def dma(d: str, b: CopyBatch) -> None:
        issue_dma(b, attrs[d], dma_streams[d].cuda_stream, fixed(128))

    def timed(issue: Callable[[], None], nbytes: int) -> float:
        return gbps(nbytes, median_seconds(lambda: wall(issue), REPS))

    for d in ("H2D", "D2H"):
        for grid in (sm, 2 * sm):
            r = timed(
                lambda d=d, g=grid: [kernel(d, b, g) for b in jobs[d]] and None, setup.pass_bytes
            )
            print(f"{label} {d} hosttable kernel grid={grid}: {r:.1f} GB/s", flush=True)
    both_bytes = 2 * half * setup.pass_bytes // n
    for h2d_way, d2h_way in (
        ("kernel", "kernel"),
        ("dma", "kernel"),
        ("kernel", "dma"),
        ("dma", "dma"),
    ):
        ways = {
            "H2D": kernel if h2d_way == "kernel" else dma,
            "D2H": kernel if d2h_way == "kernel" else dma,
        }

        def both(ways: dict[str, Callable[[str, CopyBatch], None]] = ways) -> None:
            # the kernel side first in each pair: its launch returns at once, DMA issue blocks
            order = sorted(("H2D", "D2H"), key=lambda d: ways[d] is dma)
            for k in range(half):
                for d in order:
                    ways[d](d, jobs[d][k] if d == "D2H" else jobs[d][n - half + k])

        print(
            f"{label} both H2D {h2d_way} + D2H {d2h_way}: {timed(both, both_bytes):.1f} GB/s",
            flush=True,
        )
    if block <= 64 * KIB:
        for d in ("H2D", "D2H"):
            for share in (0.6, 0.7, 0.8, 0.9):
                parts = []
                for b in jobs[d]:
                    k = int(b.count * share)
                    parts.append((part(b, 0, k), part(b, k, b.count)))

                def hybrid(d: str = d, parts: list[tuple[CopyBatch, CopyBatch]] = parts) -> None:
                    for on_kernel, on_dma in parts:
                        kernel(d, on_kernel)
                        dma(d, on_dma)

                r = timed(hybrid, setup.pass_bytes)
                print(f"{label} {d} hybrid kernel share {share}: {r:.1f} GB/s", flush=True)
    # the SM path on contiguous pinned memory: is scatter or the SM path itself the limit?
    count = jobs["H2D"][0].count
    host = torch.empty(count * block, dtype=torch.uint8, pin_memory=True)
    for d in ("H2D", "D2H"):
        row = 0 if d == "H2D" else 1
        contiguous = []
        for b in jobs[d]:
            c = pinned(b)
            c.rows[row] = host.data_ptr() + np.arange(b.count, dtype=np.int64) * block
            contiguous.append(c)
        r = timed(lambda d=d, c=contiguous: [kernel(d, b) for b in c] and None, setup.pass_bytes)
        print(f"{label} {d} hosttable kernel, host side contiguous: {r:.1f} GB/s", flush=True)


def ordering(setup: Setup) -> None:
    """DMA descriptors in the job's order, sorted by host address, or by device address."""
    block = setup.block
    stream = torch.cuda.Stream()
    for direction in ("H2D", "D2H"):
        host_row = 0 if direction == "H2D" else 1
        attrs = attrs_for(direction)
        jobs = batches(setup, direction)
        for variant in ("job order", "host sorted", "device sorted"):
            changed = []
            for b in jobs:
                c = CopyBatch.allocate(b.count)
                key = b.rows[host_row] if variant == "host sorted" else b.rows[1 - host_row]
                c.rows[:] = b.rows if variant == "job order" else b.rows[:, np.argsort(key)]
                changed.append(c.with_total(b.total_bytes))

            def issue(jobs: list[CopyBatch] = changed, attrs: object = attrs) -> None:
                for b in jobs:
                    issue_dma(b, attrs, stream.cuda_stream, fixed(128))

            r = gbps(setup.pass_bytes, median_seconds(lambda: wall(issue), REPS))
            print(f"{block // KIB}K {direction} dma {variant}: {r:.1f} GB/s", flush=True)
            if block <= 64 * KIB:
                kernel = KernelBackend(torch.device("cuda", 0))

                alive: list[object] = []  # the pinned tables, until the kernels are done

                def launch(
                    jobs: list[CopyBatch] = changed,
                    kernel: KernelBackend = kernel,
                    alive: list[object] = alive,
                ) -> None:
                    alive.clear()
                    with torch.cuda.stream(stream):
                        alive.extend(kernel.copy(b, stream) for b in jobs)

                r = gbps(setup.pass_bytes, median_seconds(lambda: wall(launch), REPS))
                print(f"{block // KIB}K {direction} kernel {variant}: {r:.1f} GB/s", flush=True)


def device_table(batch: CopyBatch) -> torch.Tensor:
    return batch.table.to("cuda")


def launch_persistent(
    table: torch.Tensor, count: int, block: int, grid: int, chunk: int, warps: int, **hints: str
) -> None:
    chunks = max(1, block // chunk)
    copy_persistent_kernel[(grid,)](
        table, count, count * chunks, CHUNKS=chunks, CHUNK=chunk, num_warps=warps, **hints
    )


def interleaved_gbps(
    setup: Setup,
    jobs_per_direction: int,
    directions: tuple[str, ...],
    streams: dict[str, torch.cuda.Stream],
    issue: Callable[[str, int], None],
) -> float:
    """GB/s of issue(direction, job) over every job of one direction, or over the first half
    of the stores and the last half of the loads interleaved, each on its direction's stream."""
    n = jobs_per_direction
    half = n // 2 or 1
    jobs = {d: range(n) for d in directions}
    if len(directions) == 2:
        jobs = {"D2H": range(half), "H2D": range(n - half, n)}
    nbytes = sum(len(j) for j in jobs.values()) * setup.pass_bytes // n

    def go() -> None:
        for k in range(max(len(j) for j in jobs.values())):
            for d in directions:
                if k < len(jobs[d]):
                    with torch.cuda.stream(streams[d]):
                        issue(d, jobs[d][k])

    return gbps(nbytes, median_seconds(lambda: wall(go), REPS))


def persistent(setup: Setup) -> None:
    block = setup.block
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    tables = {d: [(device_table(b), b.count) for b in batches(setup, d)] for d in ("H2D", "D2H")}
    streams = {"H2D": torch.cuda.Stream(), "D2H": torch.cuda.Stream()}
    old = KernelBackend(torch.device("cuda", 0))
    old_batches = {d: batches(setup, d) for d in ("H2D", "D2H")}

    def run(directions: tuple[str, ...], issue: Callable[[str, int], None]) -> float:
        return interleaved_gbps(setup, len(tables["D2H"]), directions, streams, issue)

    def old_issue(d: str, k: int) -> None:
        old.copy(old_batches[d][k], streams[d])

    for dirs in (("H2D",), ("D2H",), ("H2D", "D2H")):
        label = "+".join(dirs)
        print(
            f"{block // KIB}K {label} current kernel: {run(dirs, old_issue):.1f} GB/s", flush=True
        )
        for chunk in sorted({min(block, 16 * KIB), min(block, 64 * KIB)}):
            for warps in (4, 8):
                for grid in (sm // 2, sm, 2 * sm, 4 * sm):

                    def new_issue(
                        d: str, k: int, g: int = grid, c: int = chunk, w: int = warps
                    ) -> None:
                        table, count = tables[d][k]
                        launch_persistent(table, count, block, g, c, w)

                    r = run(dirs, new_issue)
                    print(
                        f"{block // KIB}K {label} persistent grid={grid} chunk={chunk // KIB}K "
                        f"warps={warps}: {r:.1f} GB/s",
                        flush=True,
                    )


def contiguity(setup: Setup) -> None:
    block = setup.block
    stream = torch.cuda.Stream()
    for direction in ("H2D", "D2H"):
        jobs = batches(setup, direction)
        n = max(b.count for b in jobs)
        host = torch.empty(n * block, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n * block, dtype=torch.uint8, device="cuda")
        offsets = np.arange(n, dtype=np.int64) * block
        host_row, dev_row = (0, 1) if direction == "H2D" else (1, 0)  # rows: src, dst
        attrs = attrs_for(direction)
        for variant in ("scattered", "host contiguous", "device contiguous", "both contiguous"):
            changed = []
            for b in jobs:
                c = CopyBatch.allocate(b.count, pinned=True)
                c.rows[:] = b.rows
                if variant in ("host contiguous", "both contiguous"):
                    c.rows[host_row] = host.data_ptr() + offsets[: b.count]
                if variant in ("device contiguous", "both contiguous"):
                    c.rows[dev_row] = dev.data_ptr() + offsets[: b.count]
                changed.append(c.with_total(b.total_bytes))
            spent: list[float] = []

            def issue(
                jobs: list[CopyBatch] = changed, attrs: object = attrs, spent: list[float] = spent
            ) -> None:
                started = time.perf_counter()
                for b in jobs:
                    issue_dma(b, attrs, stream.cuda_stream, fixed(128))
                spent.append(time.perf_counter() - started)

            r = gbps(setup.pass_bytes, median_seconds(lambda: wall(issue), REPS))
            us = float(np.median(spent)) / setup.copies_per_pass * 1e6
            print(
                f"{block // KIB}K {direction} dma {variant}: {r:.1f} GB/s, issue {us:.2f} us/desc",
                flush=True,
            )
        # one descriptor per job: the engines with no per-descriptor cost at all
        whole = CopyBatch.allocate(1, pinned=True)
        src, dst = (host, dev) if direction == "H2D" else (dev, host)
        whole.rows[:, 0] = [src.data_ptr(), dst.data_ptr(), n * block]

        def issue_whole(
            jobs: list[CopyBatch] = jobs, whole: CopyBatch = whole, attrs: object = attrs
        ) -> None:
            for _ in jobs:
                issue_dma(whole, attrs, stream.cuda_stream, fixed(128))

        r = gbps(len(jobs) * n * block, median_seconds(lambda: wall(issue_whole), REPS))
        print(f"{block // KIB}K {direction} dma one descriptor per job: {r:.1f} GB/s", flush=True)


def gather(setup: Setup) -> None:
    block = setup.block
    views = setup.pair.cpu_tensors  # (rows, page) strided views of rank 0's cells
    rows = views[0].shape[0]
    ids = torch.from_numpy(np.random.default_rng(2).permutation(rows)[:4096]).long()
    n = len(ids)
    staging = torch.empty((len(views), n, block), dtype=torch.uint8, pin_memory=True)
    byte_views = [v.view(torch.uint8).reshape(rows, -1) for v in views]
    nbytes = n * block * len(views)
    for threads in (1, 2, 4, 8, 16):
        torch.set_num_threads(threads)

        def do_gather() -> float:
            started = time.perf_counter()
            for t, v in enumerate(byte_views):
                torch.index_select(v, 0, ids, out=staging[t])
            return time.perf_counter() - started

        def do_scatter() -> float:
            started = time.perf_counter()
            for t, v in enumerate(byte_views):
                v.index_copy_(0, ids, staging[t])
            return time.perf_counter() - started

        g = gbps(nbytes, median_seconds(do_gather, REPS))
        s = gbps(nbytes, median_seconds(do_scatter, REPS))
        print(
            f"{block // KIB}K cpu threads={threads}: gather {g:.1f} GB/s, scatter {s:.1f} GB/s",
            flush=True,
        )
    torch.set_num_threads(torch.get_num_threads())


def variants(setup: Setup) -> None:
    """Cache hints, chunk sizes and uneven grids for the persistent kernel."""
    block = setup.block
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    tables = {d: [(device_table(b), b.count) for b in batches(setup, d)] for d in ("H2D", "D2H")}
    streams = {"H2D": torch.cuda.Stream(), "D2H": torch.cuda.Stream()}

    def run(directions: tuple[str, ...], args: dict[str, dict[str, object]]) -> float:
        def issue(d: str, k: int) -> None:
            table, count = tables[d][k]
            launch_persistent(table, count, block, **args[d])  # type: ignore[arg-type]

        return interleaved_gbps(setup, len(tables["D2H"]), directions, streams, issue)

    base: dict[str, object] = {"grid": 2 * sm, "chunk": min(block, 16 * KIB), "warps": 4}
    hint_sets: list[dict[str, str]] = [
        {},
        {"LOAD_CACHE": ".cg"},
        {"LOAD_CACHE": ".cv"},
        {"STORE_CACHE": ".cs"},
        {"STORE_CACHE": ".wt"},
        {"STORE_CACHE": ".cg"},
        {"EVICT": "evict_first"},
        {"LOAD_CACHE": ".cv", "STORE_CACHE": ".cs"},
    ]
    for direction in ("H2D", "D2H"):
        for hints in hint_sets:
            try:
                r = run((direction,), {direction: base | hints})
                print(
                    f"{block // KIB}K {direction} persistent {hints or 'no hints'}: {r:.1f} GB/s",
                    flush=True,
                )
            except Exception as exc:
                print(f"{block // KIB}K {direction} persistent {hints}: {type(exc).__name__}")
        for chunk in (4 * KIB, 8 * KIB, 32 * KIB):
            if chunk <= block:
                r = run((direction,), {direction: base | {"chunk": chunk}})
                print(
                    f"{block // KIB}K {direction} persistent chunk={chunk // KIB}K: {r:.1f} GB/s",
                    flush=True,
                )
    for h2d_grid, d2h_grid in [
        (sm, sm),
        (2 * sm, 2 * sm),
        (3 * sm, sm),
        (sm, 3 * sm),
        (2 * sm, sm),
        (sm, 2 * sm),
        (3 * sm, 3 * sm),
    ]:
        for chunk in sorted({min(block, 8 * KIB), min(block, 16 * KIB)}):
            args = {
                "H2D": base | {"grid": h2d_grid, "chunk": chunk},
                "D2H": base | {"grid": d2h_grid, "chunk": chunk},
            }
            r = run(("H2D", "D2H"), args)
            grids = f"H2D={h2d_grid} D2H={d2h_grid} chunk={chunk // KIB}K"
            print(f"{block // KIB}K both persistent grids {grids}: {r:.1f} GB/s", flush=True)


def staged(setup: Setup) -> None:
    """Where a staged job's time goes: the runs' DMA alone, the gather/scatter alone, and
    the handler with several buffer sizes."""
    for direction in ("H2D", "D2H"):
        staged_direction(setup, direction)


def staged_direction(setup: Setup, direction: str) -> None:
    from bench_transfer import handler_gbps

    from kvshm.transfer import TransferOptions
    from kvshm.transfer.backends.staged import StagedBackend, staged_tables

    label = f"{setup.block // KIB}K x{len(setup.pair.gpu_tensors)}"
    for mib, count in ((8, 2), (8, 3), (16, 2), (32, 2), (32, 3), (64, 2)):
        options = TransferOptions(staging_buffer_bytes=mib << 20, staging_buffers=count)
        r = handler_gbps(setup, direction, REPS, backend="staged", options=options)[0]
        print(f"{label} {direction} staged {count} x {mib} MiB: {r:.1f} GB/s", flush=True)
    jobs = batches(setup, direction)
    whole = max(b.total_bytes for b in jobs)
    buffer = torch.empty(whole, dtype=torch.uint8, device="cuda")
    gpu_to_cpu = direction == "D2H"
    stream = torch.cuda.Stream()
    attrs = attrs_for(direction)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    kernel = KernelBackend(torch.device("cuda", 0), programs=2 * sms)  # as the staged backend's
    prepared = []
    for b in jobs:
        planner = StagedBackend(torch.device("cuda", 0), gpu_to_cpu, None, None, whole, 2)  # type: ignore[arg-type]
        plan = planner.plan(b)
        assert plan is not None and plan.pieces == 1
        bases = np.array([buffer.data_ptr()], dtype=np.int64)
        table, runs = staged_tables(b, plan, bases, gpu_to_cpu)
        prepared.append((table, runs, int(b.sizes.max())))
    runs_each = np.mean([p[1].count for p in prepared])

    def dma_only() -> None:
        for _, runs, _ in prepared:
            issue_dma(runs, attrs, stream.cuda_stream, fixed(128))

    def kernel_only() -> None:
        with torch.cuda.stream(stream):
            for table, _, largest in prepared:
                kernel.launch(table, 0, table.shape[1], largest)

    def serial() -> None:
        with torch.cuda.stream(stream):
            for table, runs, largest in prepared:
                if gpu_to_cpu:
                    kernel.launch(table, 0, table.shape[1], largest)
                issue_dma(runs, attrs, stream.cuda_stream, fixed(128))
                if not gpu_to_cpu:
                    kernel.launch(table, 0, table.shape[1], largest)

    for name, issue in (
        ("runs DMA only", dma_only),
        ("gather/scatter kernel only", kernel_only),
        ("one piece per job, one stream", serial),
    ):
        r = gbps(setup.pass_bytes, median_seconds(lambda issue=issue: wall(issue), REPS))
        print(f"{label} {direction} {name} ({runs_each:.0f} runs/job): {r:.1f} GB/s", flush=True)


def overlap(setup: Setup) -> None:
    """Per backend: GB/s over 16 back-to-back jobs (steady state, not a burst from idle),
    and beside a stream of matrix products: how fast each goes, and how much each slows
    the other (what a serving engine's decode steps would feel)."""
    from bench_transfer import (
        Compute,
        HandlerRun,
        beside_compute,
        handler_for,
        specs_for,
        submit_and_wait,
    )

    label = f"{setup.block // KIB}K x{len(setup.pair.gpu_tensors)}"
    compute = Compute()
    variants = [("kernel", 0), ("kernel", 8), ("kernel", 16), ("kernel", 66), ("kernel", 264)]
    variants += [("dma", 0), ("staged", 0)]
    if "--kernel-only" in sys.argv:
        variants = variants[:5]
    for direction in ("H2D", "D2H"):
        for backend, programs in variants:
            try:
                handler = handler_for(setup, direction, backend=backend)
            except Exception as exc:
                print(f"{label} {direction} {backend}: {exc}", flush=True)
                continue
            if programs:
                handler._chooser._backends["kernel"]._max_programs = programs
                backend = f"kernel grid {programs}"
            specs = specs_for(setup, direction) * 4
            nbytes = 4 * setup.pass_bytes
            steady = gbps(nbytes, median_seconds(HandlerRun([handler], [specs]), REPS))
            rate, slow = beside_compute(compute, nbytes, submit_and_wait(handler, specs), REPS)
            handler.shutdown()
            print(
                f"{label} {direction} {backend}: steady {steady:.1f} GB/s; beside matmuls "
                f"{rate:.1f} GB/s, matmuls take {slow:.2f}x as long",
                flush=True,
            )


def main_layers() -> None:
    rng = np.random.default_rng(1)
    layouts = ((16 * KIB, 2), (64 * KIB, 2), (16 * KIB, 32))
    if "--kernel-only" in sys.argv:
        layouts = ((16 * KIB, 2), (256 * KIB, 2))
    if "--staged-only" in sys.argv:  # staging buffer sizes, 1 GiB per timing
        for page in (16 * KIB, 64 * KIB):
            setup = make_setup(page, "/dev/shm", rng, tensors=32)
            try:
                staged(setup)
            finally:
                setup.close()
        return
    for page, tensors in layouts:
        setup = make_setup(page, "/dev/shm", rng, tensors=tensors, pass_bytes=BURST_BYTES)
        try:
            overlap(setup)
            if tensors > 2 and "--staged" in sys.argv:
                staged(setup)
        finally:
            setup.close()


PARTS = {
    "ordering": ordering,
    "hosttable": hosttable,
    "variants": variants,
    "persistent": persistent,
    "contiguity": contiguity,
    "gather": gather,
}


def main() -> None:
    if sys.argv[1:2] == ["layers"]:
        main_layers()
        return
    args = sys.argv[1:]
    directory = "/dev/shm"
    if args and args[0].startswith("--dir="):
        directory = args.pop(0).split("=", 1)[1]
    chosen = args or list(PARTS)
    print(
        f"device: {torch.cuda.get_device_name()}; {torch.get_num_threads()} CPU threads", flush=True
    )
    rng = np.random.default_rng(1)
    for block in (16 * KIB, 64 * KIB, 256 * KIB, 1024 * KIB):
        setup = make_setup(block, directory, rng, pass_bytes=BURST_BYTES)
        try:
            for name in chosen:
                if name == "gather" and block > 64 * KIB:
                    continue
                PARTS[name](setup)
        finally:
            setup.close()


if __name__ == "__main__":
    main()
