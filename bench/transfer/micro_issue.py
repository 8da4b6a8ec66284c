"""Per-call CPU cost of the pieces of transfer_async (torch stream/event calls, the pinned
table, the Triton launch, planning), to see where a small job's time goes.

    PYTHONPATH=agent:operator python3 bench/transfer/micro_issue.py
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
import triton
from bench_transfer import KIB, MIB, handler_for, make_setup

from kvshm.transfer.backends.triton_copy import copy_blocks_kernel
from kvshm.transfer.specs import CPULoadStoreSpec, GPULoadStoreSpec


def per_call(name: str, call: Callable[[], object], n: int = 2000) -> None:
    for _ in range(50):
        call()
    started = time.perf_counter()
    for _ in range(n):
        call()
    print(f"{name}: {(time.perf_counter() - started) / n * 1e6:.2f} us", flush=True)


def main() -> None:
    print(f"torch {torch.__version__}, triton {triton.__version__}")
    device = torch.device("cuda", 0)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    ev = torch.cuda.Event()
    per_call("current_stream(device)", lambda: torch.cuda.current_stream(device))
    per_call("current_stream()", lambda: torch.cuda.current_stream())
    per_call("current_device()", lambda: torch.cuda.current_device())
    per_call("s1.wait_stream(s2)", lambda: s1.wait_stream(s2))
    per_call("ev.record(s2); s1.wait_event(ev)", lambda: (ev.record(s2), s1.wait_event(ev)))
    per_call("Event(enable_timing=True)", lambda: torch.cuda.Event(enable_timing=True))
    per_call("ev.record(s1)", lambda: ev.record(s1))
    per_call("ev.query()", lambda: ev.query())

    def device_ctx() -> None:
        with torch.cuda.device(device):
            pass

    def stream_ctx() -> None:
        with torch.cuda.stream(s1):
            pass

    per_call("with torch.cuda.device(d)", device_ctx)
    per_call("with torch.cuda.stream(s)", stream_ctx)
    table = torch.zeros((3, 32), dtype=torch.int64)
    per_call(
        "torch.empty((3,32), pin_memory=True)",
        lambda: torch.empty((3, 32), dtype=torch.int64, pin_memory=True),
    )
    pinned = torch.empty((3, 32), dtype=torch.int64, pin_memory=True)
    per_call("pinned.copy_(table) (3x32)", lambda: pinned.copy_(table))
    per_call("np.copyto (3x32)", lambda: np.copyto(pinned.numpy(), table.numpy()))
    per_call("torch.empty((3,32)) cpu", lambda: torch.empty((3, 32), dtype=torch.int64))
    zero = torch.zeros((3, 1), dtype=torch.int64, pin_memory=True)
    base = zero.data_ptr()

    def launch() -> object:
        with torch.cuda.stream(s1):
            return copy_blocks_kernel[(1,)](base, base + 8, base + 16, 1, 1, CHUNK_BYTES=16384)

    launch()  # compiles
    torch.cuda.synchronize()
    per_call("triton kernel[grid](...) launch", launch, 500)
    from kvshm.transfer.backends.kernel import KernelBackend

    backend = KernelBackend(device)
    print(f"direct launch in use: {backend._compiled is not None}")
    per_call(
        "KernelBackend.launch (1 copy)",
        lambda: backend.launch(zero, 0, 1, 16, s1.cuda_stream),
        500,
    )
    torch.cuda.synchronize()

    rng = np.random.default_rng(0)
    setup = make_setup(16 * KIB, "/dev/shm", rng, pass_bytes=256 * MIB)
    rows = setup.pair.cpu_tensors[0].shape[0]
    for direction in ("H2D", "D2H"):
        handler = handler_for(setup, direction)
        for blocks in (1, 16, 256):
            g, c = rng.permutation(rows)[:blocks], rng.permutation(rows)[:blocks]
            gpu, cpu = GPULoadStoreSpec(g, [blocks], [0]), CPULoadStoreSpec(c)
            spec = (gpu, cpu) if direction == "D2H" else (cpu, gpu)
            planner, chooser = handler._planner, handler._chooser
            per_call(f"{direction} plan {blocks} blocks", lambda s=spec, p=planner: p.plan(s))
            batch = planner.plan(spec)
            per_call(f"{direction} choose {blocks}", lambda b=batch, c=chooser: c.choose(b))
        metrics = handler._metrics
        per_call(f"{direction} metrics.finished", lambda m=metrics: m.finished(1, 0.1, "dma"))
        handler.shutdown()
    setup.close()


if __name__ == "__main__":
    main()
