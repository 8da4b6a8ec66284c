"""Which backends a calibration tries, and how a choice is made of their measured times."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from kvshm.transfer.backends.base import BackendName
from kvshm.transfer.choice.chooser import BACKEND_NAMES, SM_FREE_BACKENDS, BackendPolicy
from kvshm.transfer.metrics import Direction

CHOICES = ("store", "load", "store_beside", "load_beside")
"""What a choice names a backend for (choose_backends says what each means)."""

MARGIN = 0.03  # times within this of the fastest are a tie: runs of a few ms tell no finer
# How much of the engine's compute each backend takes (docs/transfer.md); a tie goes to the
# backend that takes the least, the measurement not seeing it.
SM_USE: dict[str, int] = {
    BackendName.DMA: 0,
    BackendName.CPU: 0,
    BackendName.STRIDED: 0,
    BackendName.STAGED: 1,
    BackendName.KERNEL: 2,
}
# The copy kernel holds SMs for the whole copy, which costs the engine's compute far more than
# staging does (docs/transfer.md): it is taken only where it beats every choice
# without it by more than this.
KERNEL_MARGIN = 0.10


def measured_backends(sm_free: bool) -> tuple[str, ...]:
    """The backends a measurement may choose among, of those the handlers have: under
    copy-engines those that leave the SMs to the model, else every one but the strided
    backend (worth_trying says why)."""
    if sm_free:
        return SM_FREE_BACKENDS
    return tuple(b for b in BACKEND_NAMES if b != BackendName.STRIDED)


def worth_trying(
    backends: Sequence[str], pages: Sequence[int], gpu_to_cpu: bool, sm_free: bool = False
) -> list[str]:
    """The backends the measurement tries for pages of these sizes.

    sm_free (kvshm_backend: copy-engines): those that leave the SMs to the model. Otherwise
    not the strided backend, whose trial on scratch blocks ties with staging's where at scale
    it moves less both ways (docs/transfer.md), and the copy kernel only where the policy
    would give it the jobs (pages averaging under its kernel_below_bytes), where the copy
    engines are bound by their descriptors: it holds SMs for the whole transfer, and at large
    pages, where a trial had chosen it, it moved less than DMA does."""
    tried = [b for b in backends if b in measured_backends(sm_free)]
    if sm_free:
        return tried
    direction = Direction.GPU_TO_CPU if gpu_to_cpu else Direction.CPU_TO_GPU
    kernel_below = BackendPolicy().kernel_below_bytes.get(direction, 0)
    mean_page = sum(pages) / max(len(pages), 1)
    others = [b for b in tried if b != BackendName.KERNEL]
    if BackendName.KERNEL in tried and others and mean_page >= kernel_below:
        return others
    return tried


def choose_backends(
    alone: Mapping[str, Mapping[str, float]],
    both: Mapping[tuple[str, str], float],
    policy: Mapping[str, str],
) -> dict[str, str]:
    """Per direction the backend for jobs while the other direction is idle ("store",
    "load": the fastest alone) and while it is busy ("store_beside", "load_beside": the
    fastest pair both ways at once): on some hosts the copy engines win one way while
    staging wins both ways, one thread issuing both directions' descriptors. Times within
    MARGIN of the fastest are a tie, which goes to the backend (or pair) that takes the
    least of the engine's SMs (SM_USE), then to the per-block-size policy's pick, then the
    faster; the copy kernel must be faster than every choice without it by KERNEL_MARGIN.

    alone: {"store"|"load": {backend: seconds}}; both: {(store, load): seconds};
    policy: {"store"|"load": the per-block-size policy's pick}."""
    choice = {
        name: break_ties({(b,): t for b, t in times.items()}, (policy.get(name, ""),))[0]
        for name, times in alone.items()
    }
    if not both:
        return choice
    policy_pair = (policy.get("store", ""), policy.get("load", ""))
    store, load = break_ties(both, policy_pair)
    return {**choice, "store_beside": store, "load_beside": load}


Backends = TypeVar("Backends", bound=tuple[str, ...])  # one backend, or a store+load pair


def break_ties(times: Mapping[Backends, float], policy: Backends) -> Backends:
    """The fastest backends, a tie (within MARGIN) going to what takes the least of the
    engine's SMs (SM_USE), then the policy; the copy kernel only where it is faster than
    every choice without it by KERNEL_MARGIN."""
    without_kernel = {key: t for key, t in times.items() if BackendName.KERNEL not in key}
    if without_kernel and min(without_kernel.values()) <= min(times.values()) * (1 + KERNEL_MARGIN):
        times = without_kernel
    fastest = min(times.values())
    tied = [key for key, seconds in times.items() if seconds <= fastest * (1 + MARGIN)]

    def rank(key: Backends) -> tuple[int, bool, float]:
        return sum(SM_USE.get(b, 2) for b in key), key != policy, times[key]

    return min(tied, key=rank)
