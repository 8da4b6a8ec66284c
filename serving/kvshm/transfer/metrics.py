"""Transfer metrics in the process's default Prometheus registry, so the serving engine's own
/metrics endpoint shows them (docs/metrics.md lists the contract)."""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from prometheus_client import Counter, Histogram

FinishedJob = tuple[int, float, str]
"""A retired job: its bytes, its seconds, and the backend that moved it (one of the few copy
backend names: dma, kernel, staged, strided, cpu)."""


class Direction(StrEnum):
    GPU_TO_CPU = "gpu_to_cpu"
    CPU_TO_GPU = "cpu_to_gpu"


_BYTES = Counter(
    "kvshm_transfer_bytes_total", "Bytes moved by finished transfer jobs", ["direction"]
)
_SECONDS = Counter(
    "kvshm_transfer_seconds_total",
    "Time finished transfer jobs took, start to end of their copies",
    ["direction"],
)
_JOBS = Counter(
    "kvshm_transfer_jobs_total",
    "Finished transfer jobs, by the copy backend that moved them",
    ["direction", "backend"],
)
_FAILURES = Counter("kvshm_transfer_failures_total", "Failed transfer jobs", ["direction"])
_SIZE = Histogram(
    "kvshm_transfer_size_bytes",
    "Bytes per transfer job",
    ["direction"],
    buckets=tuple(float(2**power) for power in range(16, 34, 2)),  # 64 KiB .. 8 GiB
)


class TransferMetrics:
    """The metric children of one direction, resolved once."""

    def __init__(self, direction: Direction) -> None:
        label = direction.value
        self._bytes = _BYTES.labels(label)
        self._seconds = _SECONDS.labels(label)
        self._failures = _FAILURES.labels(label)
        self._size = _SIZE.labels(label)
        self._label = label
        self._jobs: dict[str, Counter] = {}

    def finished(self, jobs: Iterable[FinishedJob]) -> None:
        """Jobs retired together: each counter moves once for all of them (a get_finished
        call retires dozens of small jobs on the engine's thread, and every update takes a
        lock), the size histogram once per job."""
        moved = 0
        seconds = 0.0
        per_backend: dict[str, int] = {}
        for size_bytes, job_seconds, backend in jobs:
            moved += size_bytes
            seconds += job_seconds
            per_backend[backend] = per_backend.get(backend, 0) + 1
            self._size.observe(size_bytes)
        if not per_backend:
            return
        self._bytes.inc(moved)
        self._seconds.inc(seconds)
        for backend, count in per_backend.items():
            if backend not in self._jobs:
                self._jobs[backend] = _JOBS.labels(self._label, backend)
            self._jobs[backend].inc(count)

    def failed(self, count: int = 1) -> None:
        self._failures.inc(count)
