"""vLLM 0.33's own SharedOffloadRegion (barrier, num_segments=32) attaches a segmented, padded
region (vllm-0.33 format, >= 2 GiB, sparse: populate false) made by kvshm's multi-file region
library; one process per rank, the region's directory as /dev/shm; patterns both ways on the
rows at every file boundary, at TP 2 and 4 and with MLA's replicated layout."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvshm.region import RegionFormat, RegionLayout
from tests.against_vllm.patterns import pattern
from tests.against_vllm.test_attach_with_vllm import _wait_for_files, _worker
from tests.agent_region import agent_made_region, attach_as_worker

TENSORS, TENSOR_PAGE = 3, 2500  # cell 7500 bytes: rows of 2 cells (15000) pad to 16384


@pytest.mark.parametrize(("world", "replicated"), [(2, False), (4, False), (2, True)])
def test_vllm_attaches_a_segmented_padded_kvshm_region(
    shm_dir: Path, tmp_path: Path, world: int, replicated: bool
) -> None:
    cell = TENSORS * TENSOR_PAGE
    cells = 1 if replicated else world
    row = -(-cell * cells // 4096) * 4096
    rows = (2 << 30) // row + 1000  # just over 2 GiB: 2 files
    region_dir = shm_dir / "serving" / "seg"
    region_dir.mkdir(parents=True)
    layout = RegionLayout(rows, cell, world, RegionFormat.VLLM_0_33, replicated=replicated)
    creator = agent_made_region(region_dir, "seg", layout, populate=False)
    assert layout.row_stride == row != cell * cells and layout.file_count >= 2
    workers = []
    try:
        names = sorted(os.listdir(region_dir))
        boundaries = [f.offset // row for f in layout.files("seg")]
        blocks = sorted({b for first in boundaries for b in (first - 1, first, first + 1)
                         if 0 <= b < rows} | {rows - 1})  # fmt: skip
        job = {"engine_id": "seg", "num_chunks": rows, "kv_bytes_per_chunk": row,
               "cpu_page_size": cell, "world": world, "tensors": TENSORS,
               "tensor_page": TENSOR_PAGE, "sync_dir": str(tmp_path), "blocks": blocks,
               "replicated": replicated}  # fmt: skip
        workers = [
            _worker("0.33.0", "directory", region_dir, {**job, "rank": r}) for r in range(world)
        ]
        _wait_for_files([tmp_path / f"written.{r}" for r in range(world)], workers)
        for rank in range(cells):  # replicated: rank 0's cell is every worker's
            mine = attach_as_worker(region_dir, "seg", layout, rank)
            try:
                views = [mine.create_next_view(TENSOR_PAGE) for _ in range(TENSORS)]
                for tensor, view in enumerate(views):
                    for block in blocks:
                        assert view[block].equal(pattern("vllm", rank, block, tensor, TENSOR_PAGE))
                        view[block].copy_(pattern("kvshm", rank, block, tensor, TENSOR_PAGE))
            finally:
                mine.cleanup()
        (tmp_path / "kvshm-wrote").touch()
        for worker in workers:
            out, err = worker.communicate(timeout=300)
            assert worker.returncode == 0, err[-3000:]
            assert json.loads(out.strip().splitlines()[-1])["wrong"] == []
        # vLLM attached as a joiner and removed none of kvshm's files
        assert sorted(os.listdir(region_dir)) == names == [f.name for f in layout.files("seg")]
    finally:
        for worker in workers:
            worker.kill()
        creator.cleanup()
