"""Tuning knobs of a handler; the defaults are the measured best (docs/transfer.md)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_DESCRIPTORS_PER_CALL = 128
DEFAULT_KERNEL_CHUNK_BYTES = 16384
# Measured on an H200 (docs/transfer.md): 2 programs of 4 warps per SM move as much one way
# as a grid of one program per chunk did, and both directions at once 75-78 GB/s, not ~52.
DEFAULT_KERNEL_PROGRAMS_PER_SM = 2


@dataclass(frozen=True)
class TransferOptions:
    descriptors_per_call: int = DEFAULT_DESCRIPTORS_PER_CALL
    """cuMemcpyBatchAsync descriptors per call (64-256 measured best)."""
    use_batch_call: bool = True
    """False issues one cuMemcpyAsync per copy even where the batch call exists."""
    kernel_chunk_bytes: int = DEFAULT_KERNEL_CHUNK_BYTES
    """Bytes one program of the copy kernel moves per step."""
    kernel_programs_per_sm: int = DEFAULT_KERNEL_PROGRAMS_PER_SM
    """The copy kernel's grid: this many programs per SM, each looping over the chunks."""
    stream_per_job: bool = False
    """vLLM's scheme: each job on a pooled stream that waits for the previous job's end
    event. The default keeps all of a handler's jobs on one stream."""
