"""Tuning knobs of a handler; the defaults are the measured best (docs/transfer.md)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_DESCRIPTORS_PER_CALL = 128
DEFAULT_KERNEL_CHUNK_BYTES = 16384
# 32 programs of 4 warps keep as much in flight as the link needs and leave most SMs to the
# serving engine's compute (docs/transfer.md).
DEFAULT_KERNEL_PROGRAMS = 32


@dataclass(frozen=True)
class TransferOptions:
    descriptors_per_call: int = DEFAULT_DESCRIPTORS_PER_CALL
    """cuMemcpyBatchAsync descriptors per call (64-256 measured best)."""
    use_batch_call: bool = True
    """False issues one cuMemcpyAsync per copy even where the batch call exists."""
    kernel_chunk_bytes: int = DEFAULT_KERNEL_CHUNK_BYTES
    """Bytes one program of the copy kernel moves per step."""
    kernel_programs: int = DEFAULT_KERNEL_PROGRAMS
    """The copy kernel's grid: at most this many programs, each looping over the chunks. More
    programs move both directions at once faster (two kernels share the link better) but
    slow the serving engine's compute more."""
    staging_buffer_bytes: int = 32 * 1024 * 1024
    """Device memory per buffer of the staged backend, reserved when the handler is built for
    a layout that can stage (docs/transfer.md); a job larger than one buffer goes in pieces."""
    staging_buffers: int = 2
    """Staging buffers per handler: one is filled while the other drains. 0 turns staging off."""
    stream_per_job: bool = False
    """vLLM's scheme: each job on a pooled stream that waits for the previous job's end
    event. The default keeps all of a handler's jobs on one stream."""
