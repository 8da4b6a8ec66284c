"""CUDA registration of a region, on the lent GPU: pinned copies round-trip random bytes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvshm.region import RegionLayout, SharedOffloadRegion, pin_mmap_region

pytestmark = pytest.mark.gpu

BLOCKS, PAGE, WORKERS = 256, 64 * 1024, 4
LAYOUT = RegionLayout(BLOCKS, PAGE, WORKERS)


@pytest.mark.parametrize("max_chunk_bytes", [64 * 1024**3, 3 * PAGE * WORKERS + 1])
def test_pinned_region_round_trips_random_bytes_by_dma(shm_dir: Path, max_chunk_bytes: int) -> None:

    with SharedOffloadRegion("gpu", LAYOUT, directory=str(shm_dir)) as r:
        assert r.pin(max_chunk_bytes=max_chunk_bytes)
        assert r.is_pinned
        workers = [
            SharedOffloadRegion("gpu", LAYOUT, rank, directory=str(shm_dir))
            for rank in range(WORKERS)
        ]
        views = [w.create_next_view(PAGE) for w in workers]
        host = torch.frombuffer(r.create_kv_memoryview(), dtype=torch.int8)
        assert host.is_pinned()  # CUDA sees the mapping as registered host memory
        for rank, view in enumerate(views):
            source = torch.randint(-128, 128, view.shape, dtype=torch.int8, device="cuda")
            view.copy_(source, non_blocking=True)  # device -> registered host, by DMA
            back = torch.empty_like(source)
            back.copy_(view, non_blocking=True)  # registered host -> device
            torch.cuda.synchronize()
            assert torch.equal(back, source), f"rank {rank} bytes differ after the round trip"
        del views, host
        for worker in workers:
            worker.cleanup()
    assert not (shm_dir / "vllm_offload_gpu.mmap").exists()


def test_pin_mmap_region_is_idempotent_and_cleanup_unregisters(shm_dir: Path) -> None:

    region = SharedOffloadRegion("gpu2", LAYOUT, directory=str(shm_dir))
    assert pin_mmap_region(region) and pin_mmap_region(region)
    region.cleanup()
    assert not region.is_pinned
    # registering the same addresses again in a new mapping works: nothing was left registered
    again = SharedOffloadRegion("gpu2", LAYOUT, directory=str(shm_dir))
    assert pin_mmap_region(again)
    again.cleanup()


def test_segmented_region_pins_across_files_and_dma_lands_in_each_file(shm_dir: Path) -> None:
    # vLLM 0.33's format at 2.5 GiB: two files mapped back to back. Registration pieces of
    # 1 GiB straddle the boundary between the files, and DMA through every piece must land in
    # the file that the layout says holds that row.
    page = 160 * 1024  # 4 workers x 160 KiB = 640 KiB rows, already a multiple of 4096
    layout = RegionLayout(4096, page, WORKERS)
    files = layout.files("seg")
    assert len(files) == 2 and layout.size_bytes == 2560 * 1024**2
    with SharedOffloadRegion("seg", layout, directory=str(shm_dir), populate=False) as region:
        assert region.pin(max_chunk_bytes=1024**3)
        worker = SharedOffloadRegion("seg", layout, 1, directory=str(shm_dir), populate=False)
        view = worker.create_next_view(page)
        # the first and last rows of each file, and the rows on either side of a piece's end
        rows_per_piece = 1024**3 // layout.row_stride
        rows = sorted(
            {
                r
                for f in files
                for r in (
                    f.offset // layout.row_stride,
                    (f.offset + f.length) // layout.row_stride - 1,
                )
            }
            | {rows_per_piece - 1, rows_per_piece}
        )
        source = torch.randint(-128, 128, (len(rows), page), dtype=torch.int8, device="cuda")
        for i, row in enumerate(rows):
            view[row].copy_(source[i], non_blocking=True)  # device -> registered host
        torch.cuda.synchronize()
        for i, row in enumerate(rows):
            offset = row * layout.row_stride + layout.cell_offset(0, 1)
            holder = next(f for f in files if f.offset <= offset < f.offset + f.length)
            with open(shm_dir / holder.name, "rb") as fh:
                fh.seek(offset - holder.offset)
                written = fh.read(page)
            assert written == source[i].cpu().numpy().tobytes(), f"row {row} not in {holder.name}"
        back = torch.empty_like(source)
        for i, row in enumerate(rows):
            back[i].copy_(view[row], non_blocking=True)  # registered host -> device
        torch.cuda.synchronize()
        assert torch.equal(back, source)
        del view
        worker.cleanup()
    assert not any((shm_dir / f.name).exists() for f in files)


def test_a_worker_registers_only_its_cells_where_that_pays(shm_dir: Path) -> None:
    """4 MiB cells of 2 workers: rank 1 registers its cells (half of each row) and the bytes of
    its views round-trip; a replicated layout registers whole rows."""
    from kvshm.transfer.cuda.driver import CudaDriver

    driver = CudaDriver()
    cell = 4 * 1024**2
    layout = RegionLayout(8, cell, 2)
    with SharedOffloadRegion("cells", layout, directory=str(shm_dir)):
        worker = SharedOffloadRegion("cells", layout, 1, directory=str(shm_dir))
        assert worker.pin(cells_only=True)
        assert worker.pinned_bytes == 8 * cell
        for block in range(8):
            first = worker.address + layout.cell_offset(block, 1)
            for address in (first, first + cell - 1):
                assert driver.device_pointer(address) == address, f"block {block} not registered"
            # rank 0's cell of the row stays pageable
            assert driver.device_pointer(worker.address + layout.cell_offset(block, 0)) is None
        view = worker.create_next_view(cell)
        source = torch.randint(-128, 128, view.shape, dtype=torch.int8, device="cuda")
        view.copy_(source)
        back = torch.empty_like(source)
        back.copy_(view)
        torch.cuda.synchronize()
        assert torch.equal(back, source)
        del view
        worker.cleanup()
    replicated = RegionLayout(8, cell, 2, replicated=True)
    with SharedOffloadRegion("shared", replicated, 1, directory=str(shm_dir)) as region:
        assert region.pin(cells_only=True)
        assert region.pinned_bytes == replicated.size_bytes


@pytest.mark.parametrize("cells_only", [False, True], ids=["whole-region", "cells-only"])
def test_a_region_on_huge_pages_registers_and_round_trips(
    huge_tmpfs: Path, cells_only: bool
) -> None:
    """On a tmpfs with huge pages: the agent's region registered whole, or (Llama-3.1-70B's
    TP 4 cells: 1.25 MiB, not whole huge pages) rank 1's cells alone, registration pieces
    ending inside huge pages; DMA both ways lands in rank 1's cells."""
    from kvshm.region import memory
    from kvshm.transfer.cuda.driver import CudaDriver

    driver = CudaDriver()
    cell = 1310720
    layout = RegionLayout(8, cell, 4)  # 40 MiB of 5 MiB rows: 20 huge pages
    with SharedOffloadRegion("huge", layout, directory=str(huge_tmpfs)) as agent:
        assert memory.huge_mapped_bytes(agent.address, layout.size_bytes) == layout.size_bytes
        worker = SharedOffloadRegion("huge", layout, 1, directory=str(huge_tmpfs))
        assert worker.pin(cells_only=cells_only)
        assert worker.pinned_bytes == (8 * cell if cells_only else layout.size_bytes)
        for block in range(8):
            first = worker.address + layout.cell_offset(block, 1)
            assert driver.device_pointer(first) == first
            assert driver.device_pointer(first + cell - 1) == first + cell - 1
        view = worker.create_next_view(cell)
        source = torch.randint(-128, 128, view.shape, dtype=torch.int8, device="cuda")
        view.copy_(source, non_blocking=True)
        back = torch.empty_like(source)
        back.copy_(view, non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(back, source)
        del view
        worker.cleanup()
