"""One exchange of patterns between vLLM 0.33's own SharedOffloadRegion and kvshm's, on a
region the agent made: one vLLM process per rank (test_attach_with_vllm._worker) writes its
pattern into every (rank, block, tensor) slice of `blocks`, kvshm checks it and writes its own,
and each vLLM process checks that. Shared by the tests of segmented and huge-page regions."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from kvshm.region import RegionLayout
from tests.against_vllm.patterns import pattern
from tests.against_vllm.test_attach_with_vllm import _wait_for_files, _worker, vllm_report
from tests.agent_region import attach_as_worker


def exchange_with_vllm(
    region_dir: Path,
    instance_id: str,
    layout: RegionLayout,
    blocks: list[int],
    tensors: int,
    sync_dir: Path,
    shm: str = "directory",
) -> None:
    """Run the exchange with vLLM's /dev/shm showing the region as `shm` says
    (test_attach_with_vllm.MOUNT_SHM); vLLM must join the region, map its files and remove
    none of them."""
    world = layout.num_workers
    names = sorted(os.listdir(region_dir))
    job = {
        "engine_id": instance_id,
        "num_chunks": layout.num_blocks,
        "kv_bytes_per_chunk": layout.row_stride,
        "cpu_page_size": layout.cpu_page_size,
        "world": world,
        "tensors": tensors,
        "tensor_page": layout.cpu_page_size // tensors,
        "sync_dir": str(sync_dir),
        "blocks": blocks,
        "replicated": layout.replicated,
    }
    tensor_page = layout.cpu_page_size // tensors
    workers: list[subprocess.Popen[str]] = []
    try:
        workers = [_worker("0.33.0", shm, region_dir, {**job, "rank": r}) for r in range(world)]
        _wait_for_files([sync_dir / f"written.{r}" for r in range(world)], workers)
        for rank in range(layout.cells_per_row):  # replicated: rank 0's cell is every worker's
            mine = attach_as_worker(region_dir, instance_id, layout, rank)
            try:
                views = [mine.create_next_view(tensor_page) for _ in range(tensors)]
                for tensor, view in enumerate(views):
                    for block in blocks:
                        assert view[block].equal(pattern("vllm", rank, block, tensor, tensor_page))
                        view[block].copy_(pattern("kvshm", rank, block, tensor, tensor_page))
            finally:
                mine.cleanup()
        (sync_dir / "kvshm-wrote").touch()
        for worker in workers:
            out, err = worker.communicate(timeout=300)
            assert worker.returncode == 0, err[-3000:]
            report = json.loads(out.strip().splitlines()[-1])
            assert report == vllm_report("0.33.0", shm, layout, region_dir, instance_id)
        # vLLM attached as a joiner and removed none of kvshm's files
        assert (
            sorted(os.listdir(region_dir)) == names == [f.name for f in layout.files(instance_id)]
        )
    finally:
        for worker in workers:
            worker.kill()


def around_file_boundaries(layout: RegionLayout, instance_id: str) -> list[int]:
    """The rows on either side of each file's start, and the last row."""
    rows, stride = layout.num_blocks, layout.row_stride
    firsts = [file.offset // stride for file in layout.files(instance_id)]
    return sorted(
        {b for first in firsts for b in (first - 1, first, first + 1) if 0 <= b < rows} | {rows - 1}
    )
