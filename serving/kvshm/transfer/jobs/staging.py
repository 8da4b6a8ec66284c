"""Planning a staged copy: a job's copies regrouped into runs of contiguous host memory.

A worker's cell in a region row holds all of its tensors' pages back to back, so the pages
of one block that a job moves for many tensors form one contiguous run on the host side (and
with one worker, consecutive CPU ids join runs further). The staged backend moves each run
with one DMA descriptor between the region and a device buffer laid out like the copies, and
a device-local kernel gathers or scatters the pages between that buffer and the GPU tensors.

The plan is numpy only, so CI checks it without a GPU. Copies are split, in order, into
pieces that each fill one staging buffer (at most piece_bytes), and a run never crosses a
piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvshm.transfer.jobs.pointers import RowGeometry
from kvshm.transfer.jobs.specs import CanonicalKVCacheRef

Int64s = npt.NDArray[np.int64]


@dataclass(frozen=True)
class StagingPlan:
    offsets: Int64s
    """Per copy: its byte offset in its piece's buffer."""
    copy_piece_starts: Int64s
    """Index of each piece's first copy, and the copy count at the end."""
    run_host: Int64s
    """Per run: its first host address."""
    run_offsets: Int64s
    """Per run: its byte offset in its piece's buffer."""
    run_bytes: Int64s
    run_piece_starts: Int64s
    """Index of each piece's first run, and the run count at the end."""
    largest_copy: int

    @property
    def pieces(self) -> int:
        return len(self.copy_piece_starts) - 1

    @property
    def runs(self) -> int:
        return len(self.run_host)

    @property
    def copies(self) -> int:
        return len(self.offsets)

    @property
    def mean_run_bytes(self) -> int:
        return int(self.run_bytes.sum()) // self.runs if self.runs else 0


def plan_staging(host: Int64s, sizes: Int64s, piece_bytes: int) -> StagingPlan:
    """Runs of contiguous host memory over copies with these host addresses and sizes, taken
    in the job's order: a run is a stretch of consecutive copies, each starting where the one
    before it ends. (The planner puts each block's pages in address order, so a block whose
    pages lie back to back is one run; no sort is needed, and none is paid for.)

    Raises ValueError if a single copy is larger than piece_bytes.
    """
    count = len(host)
    largest = int(sizes.max()) if count else 0
    if largest > piece_bytes:
        raise ValueError(f"a copy of {largest} bytes does not fit a {piece_bytes}-byte buffer")
    per_piece = piece_bytes // largest if count else 1
    copy_piece_starts = np.append(np.arange(0, count, per_piece, dtype=np.int64), count)
    before = np.cumsum(sizes) - sizes  # bytes of the copies before each one
    piece_base = np.repeat(before[copy_piece_starts[:-1]], np.diff(copy_piece_starts))
    offsets = before - piece_base

    new_run = np.ones(count, dtype=bool)
    if count > 1:
        new_run[1:] = host[1:] != host[:-1] + sizes[:-1]
    new_run[copy_piece_starts[:-1]] = True
    run_first = np.flatnonzero(new_run)
    run_bytes = np.add.reduceat(sizes, run_first) if count else np.empty(0, dtype=np.int64)
    return StagingPlan(
        offsets=offsets.astype(np.int64, copy=False),
        copy_piece_starts=copy_piece_starts,
        run_host=host[run_first].astype(np.int64, copy=False),
        run_offsets=offsets[run_first].astype(np.int64, copy=False),
        run_bytes=run_bytes.astype(np.int64, copy=False),
        run_piece_starts=np.searchsorted(run_first, copy_piece_starts).astype(np.int64),
        largest_copy=largest,
    )


def layout_run_bytes(
    cpu_geometries: Sequence[RowGeometry], group_refs: Sequence[Sequence[CanonicalKVCacheRef]]
) -> int:
    """The longest run of region memory one CPU block of any group can give a job: the rows
    of refs whose CPU views lie back to back in a worker's cell (a CPU view's row holds all
    block_size_factor sub-blocks). Runs across consecutive CPU ids are not counted: they
    depend on the ids, and the per-job plan finds them."""
    longest = 0
    for refs in group_refs:
        views = sorted({cpu_geometries[r.tensor_idx] for r in refs}, key=lambda g: g.base)
        run = end = 0
        for view in views:
            run = run + view.row_width if view.base == end else view.row_width
            end = view.base + view.row_width
            longest = max(longest, run)
    return longest
