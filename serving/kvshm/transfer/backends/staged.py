"""The staged backend: the copy engines move whole runs of a region, the GPU gathers/scatters.

The copy engines reach the link only with large descriptors: the driver's time per descriptor
bounds small ones (docs/transfer.md). A job that moves many tensors' pages of each
block touches one contiguous run of the region per block (kvshm.transfer.jobs.staging), so this
backend moves each run with one descriptor between the region and a device buffer, and the
copy kernel gathers (GPU->CPU) or scatters (CPU->GPU) the pages between that buffer and the
GPU tensors, in device memory only. The kernel runs on a second stream, so piece k+1 is
gathered (or piece k-1 scattered) while piece k crosses the link; a ring of a few buffers
bounds the device memory it takes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvshm.transfer.backends.base import BackendName, CopyBackend
from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.backends.kernel import KernelBackend
from kvshm.transfer.backends.page_kernel import PageKernel, page_kernel_refusal
from kvshm.transfer.cuda.pinned import PinnedTables
from kvshm.transfer.cuda.streams import give_back, own_stream
from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.staging import StagingPlan, plan_staging
from kvshm.transfer.jobs.uniform import (
    UniformCut,
    UniformJob,
    UniformLayout,
    uniform_cut,
    uniform_runs,
    uniform_tables,
)
from kvshm.transfer.jobs.work import Stream

log = logging.getLogger(__name__)

CUTS_KEPT = 16

Move = Callable[[int, int], None]
"""Gathers or scatters piece p's pages on a stream (a raw handle): move(p, stream)."""


@dataclass
class _Buffer:
    memory: torch.Tensor
    filled: torch.cuda.Event  # the piece is in the buffer: the other stream may go on
    free: torch.cuda.Event  # the buffer's last piece is done with: it may be refilled


class StagedBackend(CopyBackend):
    """Allocates its buffers when built, so no job pays for (or synchronizes on) a device
    allocation; the factory builds it only for layouts that can form long runs."""

    name = BackendName.STAGED

    def __init__(
        self,
        device: torch.device,
        gpu_to_cpu: bool,
        dma: DmaBackend,
        kernel: KernelBackend,
        buffer_bytes: int,
        buffers: int,
    ) -> None:
        if buffers < 2:
            raise ValueError(f"staging needs at least 2 buffers to overlap, got {buffers}")
        self._gpu_to_cpu = gpu_to_cpu
        self._dma = dma
        self._kernel = kernel
        self.buffer_bytes = buffer_bytes
        self._buffer_count = buffers
        self._device = device
        self._ring: list[_Buffer] = []
        self._next = 0
        self._fill_stream: torch.cuda.Stream | None = None
        self._out_stream: torch.cuda.Stream | None = None
        self._after_done: torch.cuda.Event | None = None
        self._last: tuple[CopyBatch, StagingPlan] | None = None
        # per (block count, first buffer), at most CUTS_KEPT: the cut and its DMA table
        self._cuts_layout: UniformLayout | None = None
        self._cuts: dict[tuple[int, int], tuple[UniformCut, CopyBatch]] = {}
        self._tables = PinnedTables(pinned=device.type == "cuda")
        self._layout: UniformLayout | None = None
        self._pages: PageKernel | None = None

    def prepare_uniform(self, layout: UniformLayout) -> str | None:
        """Take the handler's uniform layout where a block fits a buffer, and build its page
        kernel (it compiles: call it while the handler is built), so that its jobs write no
        kernel table; where the page kernel refuses the layout they take the table path."""
        if self.buffer_bytes < layout.block_bytes:
            return (
                f"a block of {layout.block_bytes} bytes does not fit a staging buffer of "
                f"{self.buffer_bytes} bytes"
            )
        self._layout = layout
        reason = page_kernel_refusal(layout)
        if reason is None:
            kernel = self._kernel
            gather = self._gpu_to_cpu
            self._pages = PageKernel(
                self._device, layout, gather, kernel.chunk_bytes, kernel.programs
            )
        else:
            log.info("uniform jobs gather through kernel tables: %s", reason)
        return None

    def allocate(self) -> None:
        """Reserve the buffers and the second stream (idempotent)."""
        if self._ring:
            return
        self._fill_stream = own_stream(self._device)
        self._out_stream = own_stream(self._device) if self._gpu_to_cpu else None
        self._after_done = torch.cuda.Event()
        self._ring = [
            _Buffer(
                torch.empty(self.buffer_bytes, dtype=torch.uint8, device=self._device),
                torch.cuda.Event(),
                torch.cuda.Event(),
            )
            for _ in range(self._buffer_count)
        ]

    def close(self) -> None:
        """Give the streams back (the handler has waited for every job) and free the
        buffers, with the cuts kept for them (their DMA tables hold the buffers' addresses).
        A later job allocates again."""
        for stream in (self._fill_stream, self._out_stream):
            if stream is not None:
                give_back(stream)
        self._fill_stream = self._out_stream = None
        self._ring = []
        self._cuts_layout, self._cuts = None, {}

    def plan(self, batch: CopyBatch) -> StagingPlan | None:
        """The job's staging plan, or None if one of its copies exceeds a buffer."""
        if self._last is not None and self._last[0] is batch:
            return self._last[1]
        host = batch.dst if self._gpu_to_cpu else batch.src
        try:
            plan = plan_staging(host, batch.sizes, self.buffer_bytes)
        except ValueError:  # a copy larger than a buffer, the only thing plan_staging refuses
            return None
        self._last = (batch, plan)
        return plan

    def copy(self, batch: CopyBatch, stream: Stream, after: Stream | None = None) -> object:
        """GPU->CPU: the kernel gathers each piece on a second stream, which waits for `after`
        (the caller's compute stream), and the job's stream moves it out. CPU->GPU: the
        second stream moves each piece in, and the job's stream scatters it. Either way the
        job ends on its own stream after its last piece, and the next job's first piece may
        start before that: only a buffer's events order its reuse."""
        plan = self.plan(batch)
        self._last = None
        if plan is None:
            raise ValueError(
                f"a copy of {int(batch.sizes.max())} bytes does not fit a staging buffer of "
                f"{self.buffer_bytes} bytes: raise TransferOptions.staging_buffer_bytes or let "
                f"the handler choose another backend"
            )
        if batch.count == 0:
            return None
        used = self._take_buffers(plan.pieces)
        bases = np.array([self._ring[b].memory.data_ptr() for b in used], dtype=np.int64)
        table = self._tables.take(plan.copies)
        runs = staged_tables(batch, plan, bases, self._gpu_to_cpu, table.rows)
        move = self._table_move(table.tensor, plan.copy_piece_starts, plan.largest_copy)
        self._issue(used, runs, plan.run_piece_starts, move, stream, after)
        return table  # lent until the job is done: the kernel reads it meanwhile

    def copy_uniform(self, job: UniformJob, stream: Stream, after: Stream | None = None) -> object:
        """The same for a uniform job of the prepared layout (kvshm.transfer.jobs.uniform): its
        tables come from the block ids alone, a piece being as many whole blocks (cells) as
        fill a buffer."""
        layout = self._layout
        if layout is None:
            raise ValueError("copy_uniform before prepare_uniform")
        blocks_per_piece = self.buffer_bytes // layout.block_bytes
        count = len(job.gpu_ids)
        used = self._take_buffers(-(-count // blocks_per_piece))
        cut, runs = self._cut_for(layout, count, used, blocks_per_piece)
        if self._pages is not None:
            uniform_runs(layout, job, cut, self._gpu_to_cpu, runs.rows)
            move = self._page_move(self._pages, job, cut)
            self._issue(used, runs, cut.run_starts, move, stream, after)
            return None
        table = self._tables.take(count * layout.refs)
        uniform_tables(
            layout, job, cut, self._gpu_to_cpu, table.rows[:, : count * layout.refs], runs.rows
        )
        move = self._table_move(table.tensor, cut.copy_starts, cut.largest_copy)
        self._issue(used, runs, cut.run_starts, move, stream, after)
        return table  # lent until the job is done: the kernel reads it meanwhile

    def _table_move(
        self, table: torch.Tensor, copy_starts: npt.NDArray[np.int64], largest: int
    ) -> Move:
        """Piece p is columns copy_starts[p] .. copy_starts[p+1] of a pinned kernel table."""

        def move(piece: int, stream: int) -> None:
            first, end = int(copy_starts[piece]), int(copy_starts[piece + 1])
            self._kernel.launch(table, first, end - first, largest, stream)

        return move

    def _page_move(self, pages: PageKernel, job: UniformJob, cut: UniformCut) -> Move:
        """Piece p is blocks run_starts[p] .. run_starts[p+1] of the job, from their ids."""

        def move(piece: int, stream: int) -> None:
            first, end = int(cut.run_starts[piece]), int(cut.run_starts[piece + 1])
            pages.launch(job.gpu_ids[first:end], int(cut.staged_cells[first]), stream)

        return move

    def _cut_for(
        self, layout: UniformLayout, count: int, used: list[int], blocks_per_piece: int
    ) -> tuple[UniformCut, CopyBatch]:
        """The cut of a job of `count` blocks through the buffers `used`, and its DMA table,
        kept: a handler's jobs come in a few sizes and the ring has a few buffers, and the
        cut is most of a small job's table work. Bounded: a run of jobs of ever new sizes
        keeps the last CUTS_KEPT."""
        if layout is not self._cuts_layout:
            self._cuts_layout, self._cuts = layout, {}
        key = (count, used[0])
        kept = self._cuts.get(key)
        if kept is None:
            if len(self._cuts) >= CUTS_KEPT:
                del self._cuts[next(iter(self._cuts))]  # the oldest
            bases = np.array([self._ring[b].memory.data_ptr() for b in used], dtype=np.int64)
            cut = uniform_cut(layout, count, bases, blocks_per_piece)
            runs = cut.new_runs(self._gpu_to_cpu)
            kept = self._cuts[key] = (
                cut,
                CopyBatch(torch.from_numpy(runs), runs, count * layout.block_bytes),
            )
        return kept

    def _take_buffers(self, pieces: int) -> list[int]:
        """The ring's next `pieces` buffers, in order (a buffer may recur: its events order
        the reuse)."""
        self.allocate()
        used = [(self._next + p) % len(self._ring) for p in range(pieces)]
        self._next = (self._next + pieces) % len(self._ring)
        return used

    def _issue(
        self,
        used: list[int],
        runs: CopyBatch,
        run_starts: npt.NDArray[np.int64],
        move: Move,
        stream: Stream,
        after: Stream | None,
    ) -> None:
        # the filling stream gathers (GPU->CPU) or moves pieces in (CPU->GPU); the draining
        # stream moves them out or scatters them. A load drains on the job's own stream, which
        # so ends after its last piece; a store drains on a stream of its own, which the job's
        # stream then waits for: on the job's stream each copy out would queue behind the
        # timeline's events between jobs, as a load's copies in do not
        fill = self._fill_stream
        drain = self._out_stream if self._gpu_to_cpu else stream
        assert fill is not None and drain is not None
        if self._gpu_to_cpu and after is not None:
            assert self._after_done is not None
            # one kept event: wait_stream would create one per job (docs/transfer.md)
            self._after_done.record(after)
            fill.wait_event(self._after_done)
        for piece, b in enumerate(used):
            buffer = self._ring[b]
            piece_runs = runs.columns(int(run_starts[piece]), int(run_starts[piece + 1]))
            fill.wait_event(buffer.free)
            if self._gpu_to_cpu:
                move(piece, fill.cuda_stream)
            else:
                self._dma.issue(piece_runs, fill)
            buffer.filled.record(fill)
            drain.wait_event(buffer.filled)
            if self._gpu_to_cpu:
                self._dma.issue(piece_runs, drain)
            else:
                move(piece, drain.cuda_stream)
            buffer.free.record(drain)
        if drain is not stream:
            stream.wait_event(self._ring[used[-1]].free)


def staged_tables(
    batch: CopyBatch,
    plan: StagingPlan,
    bases: npt.NDArray[np.int64],
    gpu_to_cpu: bool,
    kernel_rows: npt.NDArray[np.int64],
) -> CopyBatch:
    """Writes the kernel's table between the GPU tensors and the buffers into the first
    plan.copies columns of kernel_rows (3 rows: source, destination, size), and returns the
    runs' DMA descriptors between the buffers and the host; `bases` holds each piece's
    buffer address."""
    starts = plan.copy_piece_starts
    piece_of_copy = np.repeat(np.arange(plan.pieces), np.diff(starts))
    piece_of_run = np.repeat(np.arange(plan.pieces), np.diff(plan.run_piece_starts))
    staged = bases[piece_of_copy] + plan.offsets
    gpu = batch.src if gpu_to_cpu else batch.dst
    table = kernel_rows[:, : plan.copies]
    table[0], table[1] = (gpu, staged) if gpu_to_cpu else (staged, gpu)
    table[2] = batch.sizes
    runs = CopyBatch.allocate(plan.runs)
    run_staged = bases[piece_of_run] + plan.run_offsets
    runs.rows[0], runs.rows[1] = (
        (run_staged, plan.run_host) if gpu_to_cpu else (plan.run_host, run_staged)
    )
    runs.rows[2] = plan.run_bytes
    return runs.with_total(int(plan.run_bytes.sum()))
