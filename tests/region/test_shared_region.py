"""SharedOffloadRegion on a real tmpfs: layout, views, create/attach races, safety, cleanup."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvshm.region import (
    InvalidInstanceIdError,
    InvalidLayoutError,
    OpenMode,
    RegionAttachTimeout,
    RegionError,
    RegionLayout,
    RegionSizeMismatchError,
    SharedOffloadRegion,
    UnsafePathError,
)

BLOCKS, PAGE, WORKERS = 64, 12288, 4
LAYOUT = RegionLayout(BLOCKS, PAGE, WORKERS)
SIZE = BLOCKS * PAGE * WORKERS  # 12288-byte cells fill whole pages: no padding


def open_region(directory: Path, rank: int | None = None, **kwargs: Any) -> SharedOffloadRegion:
    kwargs.setdefault("instance_id", "test")
    return SharedOffloadRegion(layout=LAYOUT, rank=rank, directory=str(directory), **kwargs)


def test_creator_sizes_the_file_with_vllms_name_and_private_mode(shm_dir: Path) -> None:
    with open_region(shm_dir) as region:
        path = shm_dir / "vllm_offload_test.mmap"
        assert region.mmap_path == str(path)
        assert region.is_creator
        st = path.stat()
        assert st.st_size == SIZE
        assert stat.S_IMODE(st.st_mode) == 0o600
    assert not path.exists()


def test_views_have_vllm_shapes_strides_and_offsets(shm_dir: Path) -> None:
    with open_region(shm_dir) as creator:
        for rank in range(WORKERS):
            with open_region(shm_dir, rank=rank) as region:
                assert not region.is_creator
                k = region.create_next_view(4096)
                v = region.create_next_view(8192)
                assert k.dtype == torch.int8 and k.shape == (BLOCKS, 4096)
                assert k.stride() == (PAGE * WORKERS, 1)
                assert v.shape == (BLOCKS, 8192) and v.stride() == (PAGE * WORKERS, 1)
                assert k.storage_offset() == rank * PAGE
                assert v.storage_offset() == rank * PAGE + 4096
                v[5, 0] = rank + 1
                assert creator.create_kv_memoryview()[5, rank * PAGE + 4096] == rank + 1


def test_view_overflow_names_the_overflow_in_bytes(shm_dir: Path) -> None:
    with open_region(shm_dir, rank=1) as region:
        region.create_next_view(PAGE - 100)
        with pytest.raises(InvalidLayoutError, match="overflows worker 1's 12288-byte cell by 28"):
            region.create_next_view(128)
        region.create_next_view(100)  # exactly fills the cell


def test_views_need_a_rank(shm_dir: Path) -> None:
    with open_region(shm_dir) as region, pytest.raises(RegionError, match="needs a rank"):
        region.create_next_view(16)


def test_layout_must_be_a_region_layout(shm_dir: Path) -> None:
    with pytest.raises(InvalidLayoutError, match="layout must be a RegionLayout"):
        SharedOffloadRegion("x", SIZE, directory=str(shm_dir))  # type: ignore[arg-type]


# -- four workers race, a fifth process checks every byte ------------------------------------


def _worker(directory: str, rank: int, barrier: Any, results: Any) -> None:
    barrier.wait()
    region = open_region(Path(directory), rank=rank, unlink_on_cleanup=False)
    k = region.create_next_view(PAGE // 2)
    v = region.create_next_view(PAGE // 2)
    blocks = torch.arange(BLOCKS, dtype=torch.int64).unsqueeze(1)
    k.copy_(((blocks * 7 + rank * 31) % 251).to(torch.int8).expand(-1, PAGE // 2))
    v.copy_(((blocks * 13 + rank * 17 + 1) % 253).to(torch.int8).expand(-1, PAGE // 2))
    results.put((rank, region.is_creator))
    barrier.wait()  # everyone has written before anyone unmaps
    del k, v
    region.cleanup()


def _checker(directory: str, results: Any) -> None:
    with open_region(Path(directory), mode=OpenMode.ATTACH) as region:
        rows = np.asarray(region.create_kv_memoryview()).view(np.int8)
        for rank in range(WORKERS):
            cell = rows[:, rank * PAGE : (rank + 1) * PAGE].astype(np.int64)
            blocks = np.arange(BLOCKS)[:, None]
            k = ((blocks * 7 + rank * 31) % 251).astype(np.int8).astype(np.int64)
            v = ((blocks * 13 + rank * 17 + 1) % 253).astype(np.int8).astype(np.int64)
            if not (cell[:, : PAGE // 2] == k).all() or not (cell[:, PAGE // 2 :] == v).all():
                results.put(("checker", f"rank {rank} bytes differ"))
                return
        del rows, cell
    results.put(("checker", "ok"))


def test_four_workers_race_one_creates_and_a_fifth_process_sees_every_byte(
    shm_dir: Path,
) -> None:
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(WORKERS)
    results = ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(str(shm_dir), rank, barrier, results))
        for rank in range(WORKERS)
    ]
    for process in workers:
        process.start()
    for process in workers:
        process.join(60)
        assert process.exitcode == 0
    creators = dict(results.get(timeout=5) for _ in range(WORKERS))
    assert sorted(creators) == list(range(WORKERS))
    assert sum(creators.values()) == 1  # exactly one creator

    checker = ctx.Process(target=_checker, args=(str(shm_dir), results))
    checker.start()
    checker.join(60)
    assert results.get(timeout=5) == ("checker", "ok")


# -- attach ----------------------------------------------------------------------------------


def test_attach_only_never_creates_and_times_out_clearly(shm_dir: Path) -> None:
    with pytest.raises(RegionAttachTimeout, match=r"did not appear in time.*instanceId 'test'"):
        open_region(shm_dir, rank=0, mode="attach", attach_timeout=0.05)
    assert list(shm_dir.iterdir()) == []


def test_attach_timing_out_on_a_region_locked_for_removal_says_so(shm_dir: Path) -> None:
    """The agent holds file 0 exclusively while it removes the region: an attacher that times
    out meanwhile is told the file was locked, and what to check."""
    with open_region(shm_dir) as creator:
        creator.keep_file()
    fd = os.open(shm_dir / "vllm_offload_test.mmap", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # the agent, removing the region
        with pytest.raises(RegionAttachTimeout) as caught:
            open_region(shm_dir, rank=0, mode="attach", attach_timeout=0.05)
    finally:
        os.close(fd)
    message = str(caught.value)
    for part in (
        "vllm_offload_test.mmap was still locked exclusively (flock) when the attach timeout "
        "ran out",
        "locks it so while it removes the region",
        "instanceId 'test' is placed on this node and Ready",
        "/proc/locks",
    ):
        assert part in message, message
    assert "replaced in time" not in message


def test_attach_waits_for_the_creator_to_size_the_file(shm_dir: Path) -> None:
    fd = os.open(shm_dir / "vllm_offload_test.mmap", os.O_CREAT | os.O_RDWR, 0o600)
    os.close(fd)  # created, size 0: a creator that has not sized it yet
    with pytest.raises(RegionAttachTimeout, match=f"did not reach {SIZE} bytes"):
        open_region(shm_dir, rank=0, attach_timeout=0.05)
    os.truncate(shm_dir / "vllm_offload_test.mmap", SIZE)
    with open_region(shm_dir, rank=0, attach_timeout=0.05) as region:
        assert not region.is_creator


def test_create_mode_refuses_an_existing_file(shm_dir: Path) -> None:
    with open_region(shm_dir), pytest.raises(FileExistsError, match="mode 'create' never"):
        open_region(shm_dir, mode="create")


def test_size_mismatch_is_refused_and_the_file_left_untouched(shm_dir: Path) -> None:
    path = shm_dir / "vllm_offload_test.mmap"
    path.write_bytes(b"keep me" * 1000)
    with pytest.raises(RegionSizeMismatchError, match=f"is 7000 bytes but the layout needs {SIZE}"):
        open_region(shm_dir, rank=0)
    assert path.read_bytes() == b"keep me" * 1000


def test_attacher_does_not_unlink_and_the_creator_does(shm_dir: Path) -> None:
    creator = open_region(shm_dir)
    attacher = open_region(shm_dir, rank=2)
    attacher.cleanup()
    attacher.cleanup()  # idempotent
    assert Path(creator.mmap_path).exists()
    creator.cleanup()
    creator.cleanup()
    assert not Path(creator.mmap_path).exists()


def test_creator_does_not_unlink_a_file_that_replaced_its_own(shm_dir: Path) -> None:
    creator = open_region(shm_dir)
    path = Path(creator.mmap_path)
    path.unlink()
    path.write_bytes(b"someone else's")
    creator.cleanup()
    assert path.read_bytes() == b"someone else's"


def test_cleanup_releases_views_and_memoryviews(shm_dir: Path) -> None:
    region = open_region(shm_dir, rank=0)
    view = region.create_kv_memoryview()
    region.create_next_view(64)
    region.cleanup()
    with pytest.raises(ValueError):
        view[0, 0]  # released by cleanup


# -- hostile directory -----------------------------------------------------------------------


def test_symlink_at_the_path_is_not_followed(shm_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_bytes(b"precious")
    (shm_dir / "vllm_offload_test.mmap").symlink_to(target)
    with pytest.raises(UnsafePathError, match="is a symbolic link"):
        open_region(shm_dir, rank=0)
    assert target.read_bytes() == b"precious"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_fifo_at_the_path_is_refused(shm_dir: Path) -> None:
    os.mkfifo(shm_dir / "vllm_offload_test.mmap")
    with pytest.raises(UnsafePathError, match="is a FIFO"):
        open_region(shm_dir, rank=0, attach_timeout=1)


def test_directory_at_the_path_is_refused(shm_dir: Path) -> None:
    (shm_dir / "vllm_offload_test.mmap").mkdir()
    with pytest.raises(UnsafePathError, match="is a directory"):
        open_region(shm_dir, rank=0)


def test_hard_link_at_the_path_is_refused(shm_dir: Path) -> None:
    other = shm_dir / "elsewhere"
    other.write_bytes(b"\0" * SIZE)
    os.link(other, shm_dir / "vllm_offload_test.mmap")
    with pytest.raises(UnsafePathError, match="2 hard links"):
        open_region(shm_dir, rank=0)


@pytest.mark.parametrize("bad_id", ["../escape", "a/b", "..", ""])
def test_bad_ids_are_refused_before_touching_the_filesystem(shm_dir: Path, bad_id: str) -> None:
    with pytest.raises(InvalidInstanceIdError):
        open_region(shm_dir, instance_id=bad_id)
    assert list(shm_dir.iterdir()) == []
    assert not (shm_dir.parent / "escape").exists()


@pytest.mark.parametrize("mode", [0o604, 0o666, 0o7777])
def test_world_accessible_modes_are_refused(shm_dir: Path, mode: int) -> None:
    with pytest.raises(InvalidLayoutError):
        open_region(shm_dir, file_mode=mode)


def test_group_mode_is_honoured_despite_umask(shm_dir: Path) -> None:
    old = os.umask(0o077)
    try:
        with open_region(shm_dir, file_mode=0o660) as region:
            assert stat.S_IMODE(os.stat(region.mmap_path).st_mode) == 0o660
    finally:
        os.umask(old)


# -- memory ----------------------------------------------------------------------------------


def test_populate_makes_every_page_resident(shm_dir: Path) -> None:
    with open_region(shm_dir, populate=False) as region:
        assert region.resident_bytes() == 0
        assert not region.is_fully_allocated()
        region.populate()
        assert region.resident_bytes() == SIZE
        assert region.is_fully_allocated()


def test_rank_populate_touches_only_that_workers_pages(shm_dir: Path) -> None:
    layout = RegionLayout(16, 1 << 16, 4)  # 64 KiB cells: page-aligned, no widening
    with SharedOffloadRegion("pr", layout, 2, directory=str(shm_dir), populate=True) as region:
        assert region.resident_bytes() == layout.size_bytes // 4
        assert os.fstat(region._fd).st_blocks * 512 == layout.size_bytes // 4


def test_attacher_of_a_fully_allocated_region_does_not_populate(shm_dir: Path) -> None:
    with open_region(shm_dir), open_region(shm_dir, rank=1) as attacher:
        assert attacher.populate_method is None


def test_fallocate_fallback_allocates_and_keeps_bytes(shm_dir: Path) -> None:
    from kvshm.region import PopulateMethod

    with open_region(shm_dir, populate=False) as region:
        view = region.create_kv_memoryview()
        view[3, 5] = 42
        other = open_region(
            shm_dir, rank=None, populate=True, populate_method=PopulateMethod.FALLOCATE
        )
        assert other.populate_method is PopulateMethod.FALLOCATE
        assert region.is_fully_allocated()
        assert view[3, 5] == 42
        other.cleanup()


def test_lock_and_unlock_as_root(shm_dir: Path) -> None:
    with open_region(shm_dir) as region:
        region.lock()
        assert region.is_locked
        status = Path("/proc/self/status").read_text()
        locked_kib = int(
            next(line for line in status.splitlines() if line.startswith("VmLck")).split()[1]
        )
        assert locked_kib * 1024 >= SIZE
        region.unlock()
        assert not region.is_locked


def test_progress_is_reported(shm_dir: Path) -> None:
    seen: list[int] = []
    with open_region(shm_dir, progress=seen.append):
        pass
    assert seen and max(seen) == SIZE


@pytest.mark.no_cuda
def test_pin_without_cuda_warns_and_goes_on(
    shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvshm.region import pin_mmap_region

    with open_region(shm_dir) as region:
        assert pin_mmap_region(region) is False
        assert not region.is_pinned
    assert "not pinned: no CUDA device" in caplog.text


def test_replicated_views_of_every_rank_are_the_one_shared_copy(shm_dir: Path) -> None:
    layout = RegionLayout(8, 3000, 4, replicated=True)  # rows padded to 4096 bytes
    with SharedOffloadRegion("rep", layout, directory=str(shm_dir)) as creator:
        views = []
        for rank in range(4):
            worker = SharedOffloadRegion("rep", layout, rank, directory=str(shm_dir))
            views.append((worker, worker.create_next_view(3000)))
            assert views[-1][1].storage_offset() == 0 and views[-1][1].stride() == (4096, 1)
            with pytest.raises(InvalidLayoutError, match="overflows worker"):
                worker.create_next_view(1)
        views[3][1][5, 2999] = 7
        assert all(int(view[5, 2999]) == 7 for _, view in views)
        assert creator.create_kv_memoryview()[5, 2999] == 7
        for worker, _ in views:
            worker.cleanup()


def test_a_file_truncated_while_populated_is_told_as_resized_not_as_a_full_tmpfs(
    shm_dir: Path,
) -> None:
    """Whoever may write the file (its owner) can truncate it under the creator: the populate
    faults as on a full tmpfs, and the error says what really happened."""
    mib = 1024 * 1024
    layout = RegionLayout(128, mib, 1)  # two populate chunks of 64 MiB
    path = shm_dir / "vllm_offload_cut.mmap"

    def truncate_after_the_first_chunk(done: int) -> None:
        if done < layout.size_bytes:
            os.truncate(path, 0)

    with pytest.raises(
        RegionSizeMismatchError,
        match=f"{path} changed size while it was being populated: it is 0 bytes, the layout "
        f"needs {layout.size_bytes}",
    ):
        SharedOffloadRegion(
            "cut",
            layout,
            directory=str(shm_dir),
            populate_threads=1,
            progress=truncate_after_the_first_chunk,
        )
    assert not path.exists()  # the creator still removed its file
