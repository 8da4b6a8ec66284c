"""Round four: how fast the copy engines themselves run small descriptors, with the CPU's
issue cost taken out of the timing.

Every job's descriptors are queued behind a GPU sleep on the stream; the engines start when
the sleep ends, so events around the copies time the engines alone, provided the CPU
finished issuing before the sleep did (each line says how long issuing took, against the
sleep). Variants: 128 descriptors per call or one call per job, one stream or two streams
(do two streams reach two engines?), both directions queued at once, and one direction
split between the copy kernel and the engines.

    PYTHONPATH=agent:operator python3 bench/transfer/explore_engines.py [KiB ...] [part ...]

parts: engines, hybrid, load (issue cost while the link is busy), live (the split, live)
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import torch
from bench_transfer import (
    BURST_BYTES,
    KIB,
    PASS_BYTES,
    Setup,
    gbps,
    make_setup,
    median_seconds,
    wall,
)
from explore import attrs_for, batches, fixed, issue_dma, part
from explore_limits import pinned

from kvshm.transfer.backends.kernel import KernelBackend
from kvshm.transfer.batch import CopyBatch

SLEEP_CYCLES = 400_000_000  # ~0.2 s on an H200: longer than issuing 16K descriptors
JOBS = 4  # 64 MiB each


def sleep_seconds() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(SLEEP_CYCLES)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def prequeued(
    queues: list[tuple[torch.cuda.Stream, Callable[[int], None]]],
    threads: bool = False,
    same_stream: bool = False,
) -> tuple[float, float]:
    """(engine seconds, CPU issue seconds) for each queue's issue(stream) held behind a sleep;
    with threads, each queue is issued from its own thread (ctypes lets go of the GIL); with
    same_stream, the sleep runs on the first queue's stream (no cross-stream wait at all)."""
    gate = queues[0][0] if same_stream else torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(gate):
        torch.cuda._sleep(SLEEP_CYCLES)
        opened = torch.cuda.Event(enable_timing=True)
        opened.record(gate)
    ends = [torch.cuda.Event(enable_timing=True) for _ in queues]
    for stream, _ in queues:
        if stream is not gate:
            stream.wait_event(opened)
    device = torch.cuda.current_device()

    def one(k: int) -> None:
        torch.cuda.set_device(device)
        stream, issue = queues[k]
        with torch.cuda.stream(stream):  # the kernel launches on the current stream
            issue(stream.cuda_stream)
        ends[k].record(stream)

    started = time.perf_counter()
    if threads:
        pool = [threading.Thread(target=one, args=(k,)) for k in range(len(queues))]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
    else:
        for k in range(len(queues)):
            one(k)
    issued = time.perf_counter() - started
    torch.cuda.synchronize()
    return max(opened.elapsed_time(e) for e in ends) / 1e3, issued


def run(block: int, setup: Setup) -> None:
    label = f"{block // KIB}K"
    jobs = {d: batches(setup, d)[:JOBS] for d in ("H2D", "D2H")}
    attrs = {d: attrs_for(d) for d in ("H2D", "D2H")}
    streams = [torch.cuda.Stream() for _ in range(2)]

    def issuer(d: str, parts: list[CopyBatch], per_call: int) -> Callable[[int], None]:
        return lambda stream: [issue_dma(b, attrs[d], stream, fixed(per_call)) for b in parts]

    def report(name: str, nbytes: int, count: int, result: tuple[float, float]) -> None:
        engines, issued = result
        print(
            f"{label} {name}: engines {gbps(nbytes, engines):.1f} GB/s "
            f"({engines / count * 1e6:.2f} us/desc), issue {issued / count * 1e6:.2f} us/desc "
            f"({issued * 1e3:.0f} ms of the sleep's {SLEEP * 1e3:.0f})",
            flush=True,
        )

    for d in ("H2D", "D2H"):
        nbytes = sum(b.total_bytes for b in jobs[d])
        count = sum(b.count for b in jobs[d])
        for per_call in (128, 1 << 20):
            calls = "128/call" if per_call == 128 else "one call/job"
            for _ in range(2):  # the first warms the driver
                result = prequeued([(streams[0], issuer(d, jobs[d], per_call))])
            report(f"{d} {calls} one stream", nbytes, count, result)
        for _ in range(2):
            result = prequeued([(streams[0], issuer(d, jobs[d], 128))], same_stream=True)
        report(f"{d} 128/call one stream, sleep on it", nbytes, count, result)
        halves = [
            [part(b, 0, b.count // 2) for b in jobs[d]],
            [part(b, b.count // 2, b.count) for b in jobs[d]],
        ]
        for _ in range(2):
            result = prequeued(
                [(s, issuer(d, h, 128)) for s, h in zip(streams, halves, strict=True)]
            )
        report(f"{d} 128/call two streams", nbytes, count, result)
        for _ in range(2):
            result = prequeued(
                [(s, issuer(d, h, 128)) for s, h in zip(streams, halves, strict=True)], threads=True
            )
        report(f"{d} 128/call two streams from two threads", nbytes, count, result)
    both_bytes = sum(b.total_bytes for d in jobs for b in jobs[d])
    both_count = sum(b.count for d in jobs for b in jobs[d])
    for _ in range(2):
        result = prequeued(
            [(s, issuer(d, jobs[d], 128)) for s, d in zip(streams, jobs, strict=True)]
        )
    report("both ways 128/call", both_bytes, both_count, result)


def hybrid(block: int, setup: Setup) -> None:
    """One direction split between the copy kernel (a share of each job's copies) and the
    copy engines (the rest), both queued behind the sleep: can the two paths together pass
    either alone, the CPU's issue cost aside?"""
    label = f"{block // KIB}K"
    kernel = KernelBackend(torch.device("cuda", 0))
    streams = [torch.cuda.Stream() for _ in range(2)]
    for d in ("H2D", "D2H"):
        attrs = attrs_for(d)
        jobs = [pinned(b) for b in batches(setup, d)[:JOBS]]
        nbytes = sum(b.total_bytes for b in jobs)
        for share in (1.0, 0.9, 0.8, 0.7, 0.5, 0.0):
            heads = [(b, int(b.count * share)) for b in jobs]
            tails = [part(b, k, b.count) for b, k in heads if k < b.count]

            def by_kernel(_: int, heads: list[tuple[CopyBatch, int]] = heads) -> None:
                for b, k in heads:
                    if k:
                        kernel.launch(b.table, 0, k, block)

            def by_dma(stream: int, tails: list[CopyBatch] = tails, attrs: object = attrs) -> None:
                for b in tails:
                    issue_dma(b, attrs, stream, fixed(128))

            for _ in range(2):
                engines, issued = prequeued(list(zip(streams, (by_kernel, by_dma), strict=True)))
            print(
                f"{label} {d} kernel {share:.0%} + engines {1 - share:.0%}: "
                f"{gbps(nbytes, engines):.1f} GB/s (issue {issued * 1e3:.0f} ms)",
                flush=True,
            )


def live_hybrid(block: int, setup: Setup) -> None:
    """The split of `hybrid`, live: each job's engine share is issued first (the CPU's cost
    per descriptor is what limits the engines), then the kernel is launched for the rest."""
    label = f"{block // KIB}K"
    kernel = KernelBackend(torch.device("cuda", 0))
    streams = [torch.cuda.Stream() for _ in range(2)]
    for d in ("H2D", "D2H"):
        attrs = attrs_for(d)
        jobs = [pinned(b) for b in batches(setup, d)]
        nbytes = sum(b.total_bytes for b in jobs)
        for share in (1.0, 0.9, 0.8, 0.7):
            heads = [(b, int(b.count * share)) for b in jobs]
            tails = [part(b, k, b.count) for b, k in heads]

            def issue(
                heads: list[tuple[CopyBatch, int]] = heads,
                tails: list[CopyBatch] = tails,
                attrs: object = attrs,
            ) -> None:
                for (b, k), tail in zip(heads, tails, strict=True):
                    if tail.count:
                        issue_dma(tail, attrs, streams[1].cuda_stream, fixed(128))
                    if k:
                        with torch.cuda.stream(streams[0]):
                            kernel.launch(b.table, 0, k, block)

            rate = gbps(nbytes, median_seconds(lambda i=issue: wall(i), 5))
            print(
                f"{label} {d} live kernel {share:.0%} + engines {1 - share:.0%}: {rate:.1f} GB/s",
                flush=True,
            )


def issue_under_load(block: int, setup: Setup) -> None:
    """The CPU's cost per descriptor, queued behind the sleep, while the link is idle and
    while a long copy by the engines or the kernel keeps it busy: does traffic on the link
    slow the driver's issue?"""
    label = f"{block // KIB}K"
    kernel = KernelBackend(torch.device("cuda", 0))
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    device_buffer = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    whole = CopyBatch.allocate(1, pinned=True)
    load_stream, gated = torch.cuda.Stream(), torch.cuda.Stream()
    for d in ("H2D", "D2H"):
        attrs = attrs_for(d)
        jobs = batches(setup, d)[:JOBS]
        count = sum(b.count for b in jobs)
        for load in ("idle", "engines H2D", "engines D2H", "kernel H2D", "kernel D2H"):
            src, dst = (host, device_buffer) if "H2D" in load else (device_buffer, host)
            whole.rows[:, 0] = [src.data_ptr(), dst.data_ptr(), src.numel()]
            torch.cuda.synchronize()
            with torch.cuda.stream(load_stream):
                if load.startswith("engines"):
                    issue_dma(whole, attrs_for(load[-3:]), load_stream.cuda_stream, fixed(1))
                elif load.startswith("kernel"):
                    kernel.launch(whole.table, 0, 1, src.numel())
            time.sleep(0.002)  # the long copy is under way (~20 ms for 1 GiB)
            with torch.cuda.stream(gated):
                torch.cuda._sleep(SLEEP_CYCLES)
            started = time.perf_counter()
            for b in jobs:
                issue_dma(b, attrs, gated.cuda_stream, fixed(128))
            issued = time.perf_counter() - started
            torch.cuda.synchronize()
            print(
                f"{label} {d} issue while the link is {load}: {issued / count * 1e6:.2f} us/desc",
                flush=True,
            )


# CUDA_MEMCPY3D_BATCH_OP: two CUmemcpy3DOperand (type; ptr, rowLength, layerHeight, locHint),
# the extent, the source access order and flags; 112 bytes
OP = np.dtype(
    {
        "names": [
            *(side + field for side in "sd" for field in ("t", "p", "row", "h", "lt", "li")),
            *("w", "h", "d", "order", "flags"),
        ],
        "formats": ["i4", "u8", "u8", "u8", "i4", "i4"] * 2 + ["u8", "u8", "u8", "i4", "u4"],
        "offsets": [0, 8, 16, 24, 32, 36, 40, 48, 56, 64, 72, 76, 80, 88, 96, 104, 108],
        "itemsize": 112,
    }
)


def batch3d() -> Callable[[int, int, int], int]:
    """cuMemcpy3DBatchAsync(ops, count, stream) through the driver's versioned entry point."""
    import ctypes

    from kvshm.transfer.backends.cuda_driver import cuda_driver

    driver = cuda_driver()
    lib = driver._lib
    takes_fail_idx = driver.version < 13000
    get = lib.cuGetProcAddress_v2
    get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
    get.argtypes += [ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
    function, status = ctypes.c_void_p(), ctypes.c_int()
    version = 12080 if takes_fail_idx else 13000
    code = get(b"cuMemcpy3DBatchAsync", ctypes.byref(function), version, 0, ctypes.byref(status))
    assert code == 0 and function.value, f"no cuMemcpy3DBatchAsync ({code})"
    args = [ctypes.c_size_t, ctypes.c_void_p] + ([ctypes.c_void_p] if takes_fail_idx else [])
    call = ctypes.CFUNCTYPE(ctypes.c_int, *args, ctypes.c_ulonglong, ctypes.c_void_p)(
        function.value
    )
    fail = ctypes.c_size_t(0)

    def issue(ops: int, count: int, stream: int) -> int:
        if takes_fail_idx:
            return int(call(count, ops, ctypes.byref(fail), 0, stream))
        return int(call(count, ops, 0, stream))

    return issue


def strided_ops(batch: CopyBatch, tensors: int, gpu_to_cpu: bool) -> np.ndarray | None:
    """One 2-D op per block: its `tensors` pages, contiguous in the region cell and a constant
    distance apart on the GPU; None if the GPU tensors are not evenly spaced."""
    rows = batch.rows.reshape(3, -1, tensors)
    gpu, host = (rows[0], rows[1]) if gpu_to_cpu else (rows[1], rows[0])
    page = int(rows[2, 0, 0])
    gpu_pitch = int(gpu[0, 1] - gpu[0, 0]) if tensors > 1 else page
    if gpu_pitch < page or not (np.diff(gpu, axis=1) == gpu_pitch).all():
        return None
    assert (np.diff(host, axis=1) == page).all()
    ops = np.zeros(gpu.shape[0], dtype=OP)
    src, dst = ("s", "d")
    gpu_side, host_side = (src, dst) if gpu_to_cpu else (dst, src)
    ops[gpu_side + "t"] = ops[host_side + "t"] = 1  # CU_MEMCPY_OPERAND_TYPE_POINTER
    ops[gpu_side + "p"], ops[host_side + "p"] = gpu[:, 0], host[:, 0]
    ops[gpu_side + "row"], ops[host_side + "row"] = gpu_pitch, page
    ops[gpu_side + "h"] = ops[host_side + "h"] = tensors
    ops[gpu_side + "lt"], ops[gpu_side + "li"] = 1, torch.cuda.current_device()  # device
    ops[host_side + "lt"] = 2  # host
    ops["w"], ops["h"], ops["d"] = page, tensors, 1
    ops["order"] = 1 if gpu_to_cpu else 3  # stream order for the live KV cache, else any
    ops["flags"] = 1
    return ops


def issue_ops(call: Callable[[int, int, int], int], ops: np.ndarray, stream: int) -> None:
    base = ops.ctypes.data
    for start in range(0, len(ops), 128):
        code = call(base + start * OP.itemsize, min(128, len(ops) - start), stream)
        assert code == 0, f"cuMemcpy3DBatchAsync failed with CUDA error {code}"


def strided(block: int, setup: Setup) -> None:
    """A block's pages as one 2-D copy (cuMemcpy3DBatchAsync): as many descriptors as blocks,
    not pages, with no staging buffer or kernel. Checked byte for byte, then timed from a full
    queue and live, against 1-D descriptors per page."""
    label = f"{block // KIB}K x{len(setup.pair.gpu_tensors)}"
    tensors = len(setup.pair.gpu_tensors)
    call = batch3d()
    stream = torch.cuda.Stream()
    ops = {}
    for d in ("H2D", "D2H"):
        jobs = batches(setup, d)
        made = [strided_ops(b, tensors, d == "D2H") for b in jobs]
        if any(m is None for m in made):
            print(f"{label}: GPU tensors not evenly spaced, no 2-D copies", flush=True)
            return
        ops[d] = (jobs, made)
    # bytes: a store of job 0, then a load of it back into other GPU rows
    jobs, made = ops["D2H"]
    issue_ops(call, made[0], stream.cuda_stream)
    torch.cuda.synchronize()
    cells = setup.pair.cpu_tensors
    gpu_ids = setup.stores[0][0].block_ids
    cpu_ids = setup.stores[0][1].block_ids
    for t in range(tensors):
        got = cells[t][torch.as_tensor(cpu_ids)].cuda()
        want = setup.pair.gpu_tensors[t][torch.as_tensor(gpu_ids).cuda()]
        assert torch.equal(got, want), f"2-D store: tensor {t} differs"
    print(f"{label} 2-D store of one job: every byte as expected", flush=True)
    for d in ("H2D", "D2H"):
        jobs, made = ops[d]
        nbytes = sum(b.total_bytes for b in jobs)
        attrs = attrs_for(d)
        every = len(jobs)

        def plain(stream: int, n: int, jobs: list[CopyBatch] = jobs, attrs: object = attrs) -> None:
            for b in jobs[:n]:
                issue_dma(b, attrs, stream, fixed(128))

        def two_d(stream: int, n: int, made: list[np.ndarray] = made) -> None:
            for o in made[:n]:
                issue_ops(call, o, stream)

        for name, issue in (("1-D per page", plain), ("2-D per block", two_d)):
            for _ in range(2):
                engines, issued = prequeued([(stream, lambda s, i=issue: i(s, JOBS))])
            blocks = sum(len(o) for o in made[:JOBS])
            queued = gbps(nbytes * JOBS // len(jobs), engines)
            live = gbps(
                nbytes,
                median_seconds(lambda i=issue, n=every: wall(lambda: i(stream.cuda_stream, n)), 5),
            )
            print(
                f"{label} {d} {name}: full queue {queued:.1f} GB/s "
                f"(issue {issued / blocks * 1e6:.2f} us/block); live {live:.1f} GB/s",
                flush=True,
            )
    half = len(ops["D2H"][1]) // 2
    both = list(zip(ops["D2H"][1][:half], ops["H2D"][1][-half:], strict=True))
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def both_ways() -> None:
        for store, load in both:
            issue_ops(call, store, streams[0].cuda_stream)
            issue_ops(call, load, streams[1].cuda_stream)

    nbytes = 2 * half * ops["D2H"][0][0].total_bytes
    rate = gbps(nbytes, median_seconds(lambda: wall(both_ways), 5))
    print(f"{label} both ways 2-D per block, live: {rate:.1f} GB/s", flush=True)


SLEEP = 0.0


PARTS = {"engines": run, "hybrid": hybrid, "load": issue_under_load, "strided": strided}


def main() -> None:
    global SLEEP
    args = sys.argv[1:]
    blocks = [int(a) * KIB for a in args if a.isdigit()] or [16 * KIB, 32 * KIB, 64 * KIB]
    parts = [a for a in args if not a.isdigit()] or [*PARTS, "live"]
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    SLEEP = sleep_seconds()
    rng = np.random.default_rng(1)
    for block in blocks:
        full = "strided" in parts  # 1 GiB per live timing
        setup = make_setup(
            block,
            "/dev/shm",
            rng,
            pass_bytes=PASS_BYTES if full else BURST_BYTES,
            evenly_spaced=full,
        )
        try:
            for name in parts:
                if name in PARTS:
                    PARTS[name](block, setup)
        finally:
            setup.close()
        if "strided" in parts and block == 16 * KIB:
            setup = make_setup(block, "/dev/shm", rng, tensors=32, evenly_spaced=True)
            try:
                strided(block, setup)
            finally:
                setup.close()
        if "live" in parts:
            setup = make_setup(block, "/dev/shm", rng)  # 1 GiB per timing
            try:
                live_hybrid(block, setup)
            finally:
                setup.close()


if __name__ == "__main__":
    main()
