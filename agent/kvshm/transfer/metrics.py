"""Transfer metrics in the process's default Prometheus registry, so the serving engine's own
/metrics endpoint shows them (docs/metrics.md lists the contract)."""

from __future__ import annotations

from enum import StrEnum

from prometheus_client import Counter, Histogram


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
        self._label = label
        self._failures = _FAILURES.labels(label)
        self._size = _SIZE.labels(label)

    def finished(self, size_bytes: int, seconds: float, backend: str) -> None:
        """backend: one of the few copy backend names (dma, kernel, staged, cpu)."""
        _JOBS.labels(self._label, backend).inc()
        self._bytes.inc(size_bytes)
        self._seconds.inc(seconds)
        self._size.observe(size_bytes)

    def failed(self) -> None:
        self._failures.inc()
