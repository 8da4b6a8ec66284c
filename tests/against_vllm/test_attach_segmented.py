"""vLLM 0.33's own SharedOffloadRegion (barrier, num_segments=32) attaches a segmented, padded
region (vllm-0.33 format, >= 2 GiB, sparse: populate false) made by kvshm's multi-file region
library; one process per rank, the region's directory as /dev/shm or (a data-parallel engine,
examples/serving/data-parallel) symlinks to its files in a /dev/shm of the pod's own; patterns
both ways on the rows at every file boundary, at TP 2 and 4 and with MLA's replicated layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshm.region import RegionFormat, RegionLayout
from tests.against_vllm.exchange import around_file_boundaries, exchange_with_vllm
from tests.agent_region import agent_made_region

TENSORS, TENSOR_PAGE = 3, 2500  # cell 7500 bytes: rows of 2 cells (15000) pad to 16384


@pytest.mark.parametrize(
    ("world", "replicated", "shm"),
    [(2, False, "directory"), (4, False, "directory"), (2, True, "directory"), (2, True, "links")],
)
def test_vllm_attaches_a_segmented_padded_kvshm_region(
    shm_dir: Path, tmp_path: Path, world: int, replicated: bool, shm: str
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
    try:
        blocks = around_file_boundaries(layout, "seg")
        exchange_with_vllm(region_dir, "seg", layout, blocks, TENSORS, tmp_path, shm)
    finally:
        creator.cleanup()
