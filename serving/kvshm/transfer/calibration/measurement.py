"""A calibration's timing runner: every backend each direction may use moves the workload alone,
and every pair of them both ways at once, in rounds; the medians make a Measurement."""

from __future__ import annotations

import functools
import itertools
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from kvshm.transfer.calibration.policy import choose_backends, worth_trying
from kvshm.transfer.calibration.workload import Spec, Workload
from kvshm.transfer.handler import SingleDirectionOffloadingHandler

REPS = 3  # medians of this many rounds
# each trial moves the scratch blocks this many times: one pass's fixed costs hid differences
# the link shows (docs/transfer.md)
PASSES = 4
# How much slower the issuing thread may run than during the measurement: a neighbour sharing
# its core slows a process's Python at times (docs/transfer.md). A trial is judged at
# that speed, taking at least SLOW_CPU times its submitting, so that a backend whose thread only
# just keeps ahead of its copies is not chosen to fall behind them later.
SLOW_CPU = 2.0

HandlerFactory = Callable[
    [bool, str | None, Sequence[torch.Tensor]], SingleDirectionOffloadingHandler
]
"""(gpu_to_cpu, forced backend or None, GPU tensors) -> a handler over this worker's views."""


def _run(
    store: SingleDirectionOffloadingHandler | None,
    load: SingleDirectionOffloadingHandler | None,
    stores: Sequence[Spec],
    loads: Sequence[Spec],
    ids: Iterator[int],
) -> float | None:
    """Issue the stores and loads interleaved, as an engine's steps do, PASSES times over; wait.
    Returns the seconds submitting took (the first pass's times PASSES: later passes may
    queue behind a full command buffer), or None if a job failed."""
    issued: list[tuple[SingleDirectionOffloadingHandler, int]] = []
    submitting = 0.0
    for each in range(PASSES):
        started = time.perf_counter()
        for i in range(max(len(stores), len(loads))):
            if store is not None and i < len(stores):
                gpu, cpu = stores[i]
                issued.append((store, job := next(ids)))
                store.transfer_async(job, gpu, cpu)
            if load is not None and i < len(loads):
                gpu, cpu = loads[i]
                issued.append((load, job := next(ids)))
                load.transfer_async(job, cpu, gpu)
        if each == 0:
            submitting = (time.perf_counter() - started) * PASSES
    for handler, job in issued:
        handler.wait([job])
    results = [r for h in {id(h): h for h, _ in issued}.values() for r in h.get_finished()]
    if len(results) != len(issued) or not all(r.success for r in results):
        return None
    return submitting


def judged_seconds(wall: float, submitting: float) -> float:
    """A trial's time with the issuing thread SLOW_CPU times slower than it ran."""
    return max(wall, SLOW_CPU * submitting)


def _seconds(
    store: SingleDirectionOffloadingHandler | None,
    load: SingleDirectionOffloadingHandler | None,
    stores: Sequence[Spec],
    loads: Sequence[Spec],
    ids: Iterator[int],
    device: torch.device,
) -> float:
    """One run's time, judged_seconds; infinite if any job failed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    submitting = _run(store, load, stores, loads, ids)
    if submitting is None:
        return float("inf")
    return judged_seconds(time.perf_counter() - started, submitting)


def measure(
    make: HandlerFactory,
    scratch: Sequence[torch.Tensor],
    num_chunks: int,
    groups: int,
    blocks_per_chunk: int,
    measure_stores: bool = True,
    sm_free: bool = False,
) -> Measurement:
    """Every backend each direction may use, alone; and every pair of them both ways at once.
    sm_free: only those that leave the SMs to the model (SM_FREE_BACKENDS)."""
    work = Workload.of(scratch[0].shape[0], num_chunks, groups, blocks_per_chunk)
    device = scratch[0].device
    ids = itertools.count(1)
    directions = (("store", True), ("load", False)) if measure_stores else (("load", False),)
    handlers: dict[str, dict[str, SingleDirectionOffloadingHandler]] = {}
    try:
        policy: dict[str, str] = {}
        pages = [t.shape[1] for t in scratch]
        for name, gpu_to_cpu in directions:
            probe = make(gpu_to_cpu, None, scratch)
            candidates = worth_trying(probe.backends, pages, gpu_to_cpu, sm_free)
            gpu, cpu = work.every[0]
            policy[name] = (
                probe.backend_for(gpu, cpu) if gpu_to_cpu else probe.backend_for(cpu, gpu)
            )
            probe.shutdown()
            handlers[name] = {b: make(gpu_to_cpu, b, scratch) for b in candidates}
        trials: dict[tuple[str, str, str], Callable[[], float]] = {}
        work_of = {"store": (work.every, []), "load": ([], work.every)}
        for name, by_backend in handlers.items():
            for backend, handler in by_backend.items():
                store, load = (handler, None) if name == "store" else (None, handler)
                trials[(name, backend, "")] = functools.partial(
                    _seconds, store, load, *work_of[name], ids, device
                )
        if measure_stores:
            for (s, store), (ld, load) in itertools.product(
                handlers["store"].items(), handlers["load"].items()
            ):
                trials[("both", s, ld)] = functools.partial(
                    _seconds, store, load, work.stores, work.loads, ids, device
                )
        # rounds over every trial, so that a clock ramp or a neighbour's burst falls on all of
        # them alike; the first round warms up (compiles kernels, maps buffers) and is dropped
        times: dict[tuple[str, str, str], list[float]] = {key: [] for key in trials}
        for rep in range(REPS + 1):
            for key, trial in trials.items():
                seconds = trial()
                if rep:
                    times[key].append(seconds)
        median = {key: statistics.median(values) for key, values in times.items()}
        alone = {
            name: {backend: median[(name, backend, "")] for backend in by_backend}
            for name, by_backend in handlers.items()
        }
        both = {(s, ld): t for (kind, s, ld), t in median.items() if kind == "both"}
    finally:
        for by_backend in handlers.values():
            for handler in by_backend.values():
                handler.shutdown()
    return Measurement(alone, both, policy)


@dataclass(frozen=True)
class Measurement:
    alone: dict[str, dict[str, float]]
    """{"store"|"load": {backend: seconds}} for the same bytes one way (judged_seconds)."""
    both: dict[tuple[str, str], float]
    """{(store backend, load backend): seconds} for the same bytes, half each way at once
    (judged_seconds)."""
    policy: dict[str, str] = field(default_factory=dict)
    """{"store"|"load": the backend the per-block-size policy gives these jobs}."""

    def choice(self) -> dict[str, str]:
        """policy.choose_backends of these times: the fastest backend each way alone and the
        fastest pair both ways, ties to what takes the least of the engine's SMs. The times
        are judged_seconds: what the issuing thread takes counts too."""
        return choose_backends(self.alone, self.both, self.policy)

    def summary(self) -> str:
        alone = {n: {b: round(s * 1e3, 2) for b, s in t.items()} for n, t in self.alone.items()}
        both = {f"{s}+{ld}": round(t * 1e3, 2) for (s, ld), t in self.both.items()}
        return f"ms alone {alone}, both ways {both}"
