"""The kernel backend: GPU threads read and write registered host memory directly.

For small blocks this beats the copy engines, whose cost per descriptor dominates there. It
needs Triton (shipped with torch's CUDA builds), every address and size a multiple of 16
bytes, and every CPU tensor registered with CUDA at the same address (else a thread would
fault and take the CUDA context down), so it is offered only after checking all three.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvshm.transfer.backends.base import BackendName, CopyBackend
from kvshm.transfer.cuda.driver import CudaDriver
from kvshm.transfer.cuda.pinned import PinnedTables
from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.pointers import RowGeometry
from kvshm.transfer.jobs.work import Stream
from kvshm.transfer.options import DEFAULT_KERNEL_CHUNK_BYTES, DEFAULT_KERNEL_PROGRAMS

DEFAULT_NUM_WARPS = 4

log = logging.getLogger(__name__)


def unmapped_reason(driver: CudaDriver, cpu_geometries: Sequence[RowGeometry]) -> str | None:
    """Why the GPU cannot address some CPU tensor directly, or None if it can."""
    for i, geometry in enumerate(cpu_geometries):
        last = (geometry.num_rows - 1) * geometry.row_stride + geometry.row_width - 1
        for address in (geometry.base, geometry.base + max(last, 0)):
            mapped = driver.device_pointer(address)
            if mapped is None:
                return f"CPU tensor {i} is not registered with CUDA (pin the region first)"
            if mapped != address:
                return f"CPU tensor {i} is mapped at another device address ({mapped:#x})"
    return None


def triton_missing_reason() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"Triton is not installed ({exc})"
    return None


def launch_constants(*constexprs: int) -> tuple[int, ...] | None:
    """The constexpr arguments a compiled Triton kernel's launch takes after the others, or
    None for a Triton whose launch convention kvshm does not know: 3.3 to 3.x pass every bound
    argument (measured on 3.6), earlier ones only the non-constexprs."""
    import triton

    try:
        version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    except ValueError:
        return None
    if version >= (4, 0):
        return None
    return constexprs if version >= (3, 3) else ()


class CompiledLaunch:
    """Launches a compiled Triton kernel the way Triton's own launch does, minus its per-call
    work: where this Triton's names are known (3.3 to 3.x), it hands Triton's launcher the
    kernel's function, packed metadata and arguments itself, without re-reading the handles,
    building launch metadata and calling the (empty) profiler hook chains each time. Once a
    hook is added (a profiler), launches go through Triton's own path again, which calls it.
    How a compiled kernel takes its arguments is Triton's internal interface: build one only
    through checked_launch, which tries it on a probe first."""

    def __init__(self, compiled: Any, constants: tuple[int, ...]) -> None:
        self.compiled = compiled
        self.constants = constants
        self.handles = _launch_handles(compiled)
        self._runtime = _triton_runtime_knobs()

    def __call__(self, args: tuple[int, ...], grid: int, stream: int) -> None:
        if self.handles is not None and not self.hooks_listening():
            run, function, packed = self.handles
            run(grid, 1, 1, stream, function, packed, None, None, None, *args, *self.constants)
            return
        self.compiled[(grid, 1, 1)](*args, *self.constants, stream=stream)

    def hooks_listening(self) -> bool:
        """Whether something (a profiler) listens to Triton's launches: they then go through
        Triton's own launch, which calls it."""
        if self._runtime is None:
            return True
        for hook in (self._runtime.launch_enter_hook, self._runtime.launch_exit_hook):
            if hook is not None and getattr(hook, "calls", True):  # a chain with no hooks: none
                return True
        return False


def checked_launch(
    compiled: Any,
    constants: tuple[int, ...] | None,
    probe: Callable[[CompiledLaunch], bool],
    what: str,
) -> CompiledLaunch | None:
    """A direct launch of `compiled` if `probe` (which launches through it and checks the
    bytes it moved) passes, else None: the caller then launches through Triton's JIT."""
    if constants is None:
        log.info("%s: launching through Triton's JIT (unknown launch convention)", what)
        return None
    launch = CompiledLaunch(compiled, constants)
    works = False
    try:
        works = probe(launch)
    except Exception as exc:  # an internal interface that changed: use the public one
        log.info("%s: direct launch failed (%s)", what, exc)
    if not works:
        log.info("%s: launching through Triton's JIT (slower to issue)", what)
    return launch if works else None


class KernelBackend(CopyBackend):
    name = BackendName.KERNEL

    def __init__(
        self,
        device: torch.device,
        chunk_bytes: int = DEFAULT_KERNEL_CHUNK_BYTES,
        num_warps: int = DEFAULT_NUM_WARPS,
        programs: int = DEFAULT_KERNEL_PROGRAMS,
    ) -> None:
        if chunk_bytes < 16 or chunk_bytes & (chunk_bytes - 1):
            raise ValueError(f"chunk_bytes must be a power of two >= 16, got {chunk_bytes}")
        if programs < 1:
            raise ValueError(f"programs must be >= 1, got {programs}")
        from kvshm.transfer.backends.triton_copy import copy_blocks_kernel

        self._kernel: Any = copy_blocks_kernel
        self._chunk = chunk_bytes
        self._num_warps = num_warps
        self._max_programs = programs
        self._tables = PinnedTables()
        # compile now, while the handler is built, not in the first job (~0.5 s)
        with torch.cuda.device(device):
            self._direct = self._direct_launcher(device)

    @property
    def programs(self) -> int:
        return self._max_programs

    @property
    def chunk_bytes(self) -> int:
        return self._chunk

    def _direct_launcher(self, device: torch.device) -> CompiledLaunch | None:
        """Compile the kernel and return it for direct launches, or None where a direct
        launch does not move the bytes it should. A direct launch hands Triton's launcher
        what Triton's own launch would, where this Triton's names for them are known.

        Triton's JIT launch re-binds and re-specializes the arguments on every call, a large
        share of a small job's transfer_async (docs/transfer.md); the compiled kernel
        launches in a fraction of that. Its launch arguments are not a public interface, so a
        test copy through it checks them here, and a mismatch falls back to the JIT launch."""
        probe = torch.arange(64, dtype=torch.uint8, device=device)
        at = probe.data_ptr()
        # column 0 (bytes 0-15 to 32-47) through the JIT, column 1 (16-31 to 48-63) directly
        table = torch.tensor(
            [[at, at + 16], [at + 32, at + 48], [16, 16]], dtype=torch.int64
        ).pin_memory()
        stream = torch.cuda.current_stream(device).cuda_stream
        compiled = self._jit_launch(*self._arguments(table, 0, 1, 16), stream)  # compiles

        def copies_column_1(launch: CompiledLaunch) -> bool:
            launch(*self._arguments(table, 1, 1, 16), stream)
            torch.cuda.synchronize(device)
            return bool(torch.equal(probe, torch.cat([probe[:32], probe[:32]])))

        direct = checked_launch(
            compiled, launch_constants(self._chunk), copies_column_1, "copy kernel"
        )
        torch.cuda.synchronize(device)
        return direct

    def copy(self, batch: CopyBatch, stream: Stream, after: Stream | None = None) -> object:
        if batch.count == 0:
            return None
        # the kernel reads the table from pinned memory, so no copy engine uploads it (an
        # upload would queue behind the other direction's DMA); the table is lent until the
        # job is retired, when the kernel is done with it (a pinned torch.empty per job is
        # costly: docs/transfer.md)
        table = self._tables.take(batch.count)
        table.rows[:, : batch.count] = batch.rows
        self.launch(table.tensor, 0, batch.count, int(batch.sizes.max()), stream.cuda_stream)
        return table

    def launch(
        self, table: torch.Tensor, start: int, count: int, max_size: int, stream: int | None = None
    ) -> None:
        """Copy columns start .. start+count of a pinned (3, n) table on a stream (a raw
        handle; default: the current stream)."""
        if stream is None:
            stream = torch.cuda.current_stream().cuda_stream
        args, grid = self._arguments(table, start, count, max_size)
        if self._direct is not None:
            self._direct(args, grid, stream)
        else:
            self._jit_launch(args, grid, stream)

    def _arguments(
        self, table: torch.Tensor, start: int, count: int, max_size: int
    ) -> tuple[tuple[int, ...], int]:
        """The kernel's arguments for columns start .. start+count, and its grid."""
        chunks = -(-max_size // self._chunk)
        base = table.data_ptr() + 8 * start
        row = 8 * table.shape[1]
        args = (base, base + row, base + 2 * row, count, chunks)
        return args, min(count * chunks, self._max_programs)

    def _jit_launch(self, args: tuple[int, ...], grid: int, stream: int) -> Any:
        with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
            return self._kernel[(grid,)](*args, CHUNK_BYTES=self._chunk, num_warps=self._num_warps)


def _triton_runtime_knobs() -> Any:
    """triton.knobs.runtime (Triton 3.4 and later), or None."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return getattr(knobs, "runtime", None)


def _launch_handles(compiled: Any) -> tuple[Any, Any, Any] | None:
    """The launcher, function handle and packed metadata that Triton's launch of a compiled
    kernel passes on (3.3 to 3.x), or None where this Triton has other names for them."""
    try:
        compiled._init_handles()
        return compiled.run, compiled.function, compiled.packed_metadata
    except AttributeError:
        return None
