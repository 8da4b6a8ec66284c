"""CPU time of transfer_async for small and large jobs (the serving engine pays it inside its
step), per layout and backend, in an engine's steady state: 8 jobs in flight, results
collected before each new job; --profile adds where 16-block jobs spend it.

    PYTHONPATH=agent:operator python3 bench/transfer/profile_jobs.py [--profile]
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

import numpy as np
import torch
from bench_transfer import KIB, MIB, IssueTimer, handler_for, make_setup

from kvshm.transfer.specs import CPULoadStoreSpec, GPULoadStoreSpec

LAYOUTS = ((16 * KIB, 2), (64 * KIB, 2), (2048 * KIB, 2), (16 * KIB, 32))
JOB_BLOCKS = (1, 16, 256)
JOBS = 200
WARM = 50  # jobs before the timing starts
IN_FLIGHT = 8  # jobs in flight at once; each step waits for the oldest


def specs(rows: int, blocks: int, rng: np.random.Generator, gpu_to_cpu: bool) -> list:
    out = []
    for _ in range(JOBS):
        g, c = rng.permutation(rows)[:blocks], rng.permutation(rows)[:blocks]
        gpu, cpu = GPULoadStoreSpec(g, [len(g)], [0]), CPULoadStoreSpec(c)
        out.append((gpu, cpu) if gpu_to_cpu else (cpu, gpu))
    return out


def main() -> None:
    profile = "--profile" in sys.argv
    rng = np.random.default_rng(0)
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    print(
        "| page | tensors | dir | blocks/job | backend | µs per transfer_async | of it in copy() |"
    )
    print("|---|---|---|---|---|---|---|")
    for page, tensors in LAYOUTS:
        setup = make_setup(page, "/dev/shm", rng, tensors=tensors, pass_bytes=256 * MIB)
        rows = setup.pair.cpu_tensors[0].shape[0]
        try:
            for direction in ("H2D", "D2H"):
                handler = handler_for(setup, direction)
                timer = IssueTimer(handler)  # the part of transfer_async in the backends
                next_id = 0
                for blocks in JOB_BLOCKS:
                    blocks = min(blocks, rows, max(1, (64 * MIB) // (page * tensors)))
                    jobs = specs(rows, blocks, rng, direction == "D2H")
                    first = next_id
                    backend = handler._chooser.choose(handler._planner.plan(jobs[0]))
                    profiler = cProfile.Profile() if profile and blocks == 16 else None
                    took = 0.0
                    for k, spec in enumerate(jobs + jobs[:WARM]):
                        if k == WARM:  # the engine's steady state: tables and events recycled
                            took, timer.seconds = 0.0, 0.0
                        if k >= IN_FLIGHT:  # as an engine does: results collected every step
                            handler.wait([next_id - IN_FLIGHT])
                            handler.get_finished()
                        if profiler and k >= WARM:
                            profiler.enable()
                        started = time.perf_counter()
                        handler.transfer_async(next_id, spec)
                        took += time.perf_counter() - started
                        if profiler:
                            profiler.disable()
                        next_id += 1
                    handler.wait(range(first, next_id))
                    handler.get_finished()
                    per_job, in_copy = took / JOBS * 1e6, timer.seconds / JOBS * 1e6
                    print(
                        f"| {page // KIB} KiB | {tensors} | {direction} | {blocks} | "
                        f"{backend.name} | {per_job:.1f} | {in_copy:.1f} |",
                        flush=True,
                    )
                    if profiler:
                        stats = pstats.Stats(profiler)
                        stats.sort_stats("tottime").print_stats(25)
                handler.shutdown()
        finally:
            setup.close()


if __name__ == "__main__":
    main()
