"""A vllm-0.33 region split over several files, on a real tmpfs: created, attached, mapped as one
range, populated per file, checked and removed as one region. Sparse files keep 2 GiB cheap."""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import threading
from pathlib import Path

import pytest

from kvshm.region import (
    OpenMode,
    RegionFileMissingError,
    RegionFormat,
    RegionLayout,
    RegionResizedError,
    RegionSizeMismatchError,
    SharedOffloadRegion,
    UnsafePathError,
    memory,
)
from kvshm.region.errors import RegionFileExistsError
from kvshm.region.populate import (
    MappedFile,
    PopulateMethod,
    interleave_by_file,
    split_ranges,
)

MIB = 1 << 20
# 9 rows of 256 MiB = 2.25 GiB: vLLM 0.33 makes n = 2 files, of 5 rows and of 4 rows
LAYOUT = RegionLayout(9, 256 * MIB, 1)
# 600 rows of 1024 cells of 4 KiB = 2.4 GiB in 2 files; one worker's cells are only 2.4 MiB
WIDE = RegionLayout(600, 4096, 1024)


def names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


def open_region(
    directory: Path, layout: RegionLayout = LAYOUT, **kwargs: object
) -> SharedOffloadRegion:
    kwargs.setdefault("populate", False)
    return SharedOffloadRegion("seg", layout, directory=str(directory), **kwargs)  # type: ignore[arg-type]


def open_paths() -> list[str]:
    """What this process's descriptors are open on."""
    paths = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
    return paths


def _leave_region(directory: Path) -> None:
    with open_region(directory) as region:
        region.keep_file()


def test_creator_makes_every_file_with_its_share_of_rows(shm_dir: Path) -> None:
    with open_region(shm_dir) as region:
        assert [f.name for f in region.files] == [
            "vllm_offload_seg.mmap",
            "vllm_offload_seg.mmap.1",
        ]
        assert names(shm_dir) == ["vllm_offload_seg.mmap", "vllm_offload_seg.mmap.1"]
        for file in region.files:
            st = (shm_dir / file.name).stat()
            assert st.st_size == file.length
            assert stat.S_IMODE(st.st_mode) == 0o600
        assert [f.length for f in region.files] == [5 * 256 * MIB, 4 * 256 * MIB]
    assert names(shm_dir) == []  # the creator removes every file it made


def test_the_files_are_mapped_back_to_back_as_one_range(shm_dir: Path) -> None:
    with open_region(shm_dir) as creator, open_region(shm_dir, mode=OpenMode.ATTACH) as attacher:
        assert not attacher.is_creator
        row = LAYOUT.row_stride
        created = creator.create_kv_memoryview()
        created[6, 123] = 0x5A  # row 6 lies in file 1, one row into it
        created[4, row - 1] = 0x3C  # the last byte of file 0
        seen = attacher.create_kv_memoryview()
        assert seen[6, 123] == 0x5A and seen[4, row - 1] == 0x3C
        with open(shm_dir / "vllm_offload_seg.mmap.1", "rb") as file_1:
            assert os.pread(file_1.fileno(), 1, row + 123) == b"\x5a"
        with open(shm_dir / "vllm_offload_seg.mmap", "rb") as file_0:
            assert os.pread(file_0.fileno(), 1, 5 * row - 1) == b"\x3c"
        created.release()
        seen.release()
    assert names(shm_dir) == []


def test_attachers_hold_the_region_by_a_shared_flock_on_file_0(shm_dir: Path) -> None:
    _leave_region(shm_dir)
    try:
        with open_region(shm_dir, mode=OpenMode.ATTACH):
            for name, locked in (
                ("vllm_offload_seg.mmap", True),
                ("vllm_offload_seg.mmap.1", False),
            ):
                fd = os.open(shm_dir / name, os.O_RDONLY)
                try:
                    if locked:
                        with pytest.raises(BlockingIOError):
                            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    else:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                finally:
                    os.close(fd)
    finally:
        for name in names(shm_dir):
            os.unlink(shm_dir / name)


def test_a_leftover_later_file_stops_the_creator_and_is_left_untouched(shm_dir: Path) -> None:
    stray = shm_dir / "vllm_offload_seg.mmap.1"
    stray.write_bytes(b"someone's data")
    before = stray.stat()
    with pytest.raises(RegionFileExistsError, match=r"vllm_offload_seg\.mmap\.1 already exists"):
        open_region(shm_dir)
    after = stray.stat()
    assert (after.st_ino, after.st_size) == (before.st_ino, before.st_size)
    assert stray.read_bytes() == b"someone's data"
    assert names(shm_dir) == ["vllm_offload_seg.mmap.1"]  # its own file 0 was removed


def test_an_attacher_refuses_a_missing_later_file(shm_dir: Path) -> None:
    _leave_region(shm_dir)
    os.unlink(shm_dir / "vllm_offload_seg.mmap.1")
    with pytest.raises(RegionFileMissingError, match=r"vllm_offload_seg\.mmap\.1 .* is missing"):
        open_region(shm_dir, mode=OpenMode.ATTACH)
    assert names(shm_dir) == ["vllm_offload_seg.mmap"]


def test_an_attacher_refuses_a_later_file_of_another_size_and_never_truncates(
    shm_dir: Path,
) -> None:
    _leave_region(shm_dir)
    os.truncate(shm_dir / "vllm_offload_seg.mmap.1", 4096)
    with pytest.raises(RegionSizeMismatchError, match="is 4096 bytes but the layout needs"):
        open_region(shm_dir, mode=OpenMode.CREATE_OR_ATTACH)
    assert (shm_dir / "vllm_offload_seg.mmap.1").stat().st_size == 4096


def test_a_later_file_truncated_just_before_it_is_mapped_is_refused_and_unmapped(
    shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each file of a segmented region is mapped with a raw MAP_FIXED mmap, which maps a file
    shorter than the length asked without a word: a file its owner truncates after the size
    check must still be refused, not left to SIGBUS the first store."""
    _leave_region(shm_dir)
    last = shm_dir / "vllm_offload_seg.mmap.1"
    real_map_file_at = memory.map_file_at

    def truncated_first(address: int, length: int, fd: int) -> None:
        if os.fstat(fd).st_ino == last.stat().st_ino:
            os.truncate(last, 4096)  # the owner's other process, between check and mmap
        real_map_file_at(address, length, fd)

    monkeypatch.setattr(memory, "map_file_at", truncated_first)
    with pytest.raises(RegionResizedError, match=r"mmap\.1 changed size while it was being mapped"):
        open_region(shm_dir, mode=OpenMode.ATTACH)
    maps = Path("/proc/self/maps").read_text()
    assert "vllm_offload_seg.mmap" not in maps  # every file unmapped again
    assert not [path for path in open_paths() if path.startswith(str(shm_dir))]
    assert last.stat().st_size == 4096  # left as it was


def test_an_attacher_refuses_a_symlink_for_a_later_file(shm_dir: Path) -> None:
    _leave_region(shm_dir)
    target = shm_dir / "elsewhere"
    os.rename(shm_dir / "vllm_offload_seg.mmap.1", target)
    os.symlink(target, shm_dir / "vllm_offload_seg.mmap.1")
    with pytest.raises(UnsafePathError, match="symbolic link"):
        open_region(shm_dir, mode=OpenMode.ATTACH)


def test_an_attacher_never_opens_a_fifo_in_place_of_a_later_file(shm_dir: Path) -> None:
    _leave_region(shm_dir)
    fifo = shm_dir / "vllm_offload_seg.mmap.1"
    os.unlink(fifo)
    os.mkfifo(fifo, 0o600)
    opened = threading.Event()

    def writer() -> None:  # returns only once someone opened the FIFO for reading
        os.close(os.open(fifo, os.O_WRONLY))
        opened.set()

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    with pytest.raises(UnsafePathError, match="FIFO"):
        open_region(shm_dir, mode=OpenMode.ATTACH)
    assert not opened.wait(0.5)  # the attacher refused the FIFO without opening it
    os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))  # let the writer go
    thread.join(5)
    assert opened.is_set()


def test_a_single_file_region_of_the_same_size_is_not_taken_for_a_segmented_one(
    shm_dir: Path,
) -> None:
    single = RegionLayout(9, 256 * MIB, 1, RegionFormat.VLLM_0_27)
    _keep = open_region(shm_dir, single)
    _keep.keep_file()
    _keep.cleanup()
    with pytest.raises(RegionSizeMismatchError, match="needs 1342177280 bytes"):
        open_region(shm_dir, mode=OpenMode.ATTACH)


@pytest.mark.parametrize("method", list(PopulateMethod))
def test_populate_allocates_a_workers_cells_in_every_file(
    shm_dir: Path, method: PopulateMethod
) -> None:
    with open_region(shm_dir, WIDE) as creator:
        assert len(creator.files) == 2
        with SharedOffloadRegion(
            "seg", WIDE, 5, directory=str(shm_dir), populate=True, populate_method=method
        ) as worker:
            assert worker.populate_method is method
        for file in creator.files:
            allocated = (shm_dir / file.name).stat().st_blocks * 512
            assert allocated == file.length // WIDE.row_stride * 4096  # one 4 KiB cell per row
        assert creator.allocated_bytes() == 600 * 4096
        assert not creator.is_fully_allocated()


def test_pieces_never_cross_a_file_and_alternate_between_files() -> None:
    pieces = split_ranges([(0, 10 * MIB)], 3 * MIB, [4 * MIB])
    assert pieces == [(0, 3 * MIB), (3 * MIB, MIB), (4 * MIB, 3 * MIB), (7 * MIB, 3 * MIB)]
    files = [MappedFile(0, 4 * MIB, 3), MappedFile(4 * MIB, 6 * MIB, 4)]
    assert interleave_by_file(pieces, files) == [
        (0, 3 * MIB),
        (4 * MIB, 3 * MIB),
        (3 * MIB, MIB),
        (7 * MIB, 3 * MIB),
    ]
    # a worker that starts on file 1 (vLLM starts each worker on a different file)
    assert interleave_by_file(pieces, files, first_file=1) == [
        (4 * MIB, 3 * MIB),
        (0, 3 * MIB),
        (7 * MIB, 3 * MIB),
        (3 * MIB, MIB),
    ]


def test_a_creator_populates_every_file_whole(shm_dir: Path) -> None:
    done: list[int] = []
    with open_region(shm_dir, populate=True, progress=done.append) as region:
        assert region.populate_method is PopulateMethod.MADVISE
        for file in region.files:
            assert (shm_dir / file.name).stat().st_blocks * 512 == file.length
        assert region.is_fully_allocated()
        assert region.resident_bytes() == LAYOUT.size_bytes
        assert max(done) == LAYOUT.size_bytes
    assert names(shm_dir) == []
