"""kvshm.region.index.writer.remove_index: an index an engine cannot use is removed by name, so
no later engine adopts records naming rows the engine stores over (docs/warm-restart.md). Real
files on /dev/shm."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvshm.region.index.writer import IndexUnavailable, RegionIndex, remove_index
from kvshm.region.naming import index_file_name

ID = "engine-a"
RECORDS = 64
IDENTITY = {"model.name": "llama"}
KEY = bytes(range(36))


def index_path(directory: Path) -> Path:
    return directory / index_file_name(ID)


def committed(directory: Path) -> None:
    with RegionIndex.open(str(directory), ID, RECORDS) as index:
        index.adopt(IDENTITY)
        index.commit(0, KEY, (0, 0))


def restored(directory: Path) -> list[bytes]:
    with RegionIndex.open(str(directory), ID, RECORDS) as index:
        return [record.key for record in index.adopt(IDENTITY).records]


def test_a_removed_index_restores_nothing_and_a_new_one_works(shm_dir: Path) -> None:
    committed(shm_dir)
    assert remove_index(str(shm_dir), ID) is True
    assert not index_path(shm_dir).exists()
    assert restored(shm_dir) == []
    assert remove_index(str(shm_dir), ID) is True  # the new one, then nothing
    assert remove_index(str(shm_dir), ID) is False


def test_a_locked_index_is_removed_under_its_holder(shm_dir: Path) -> None:
    """The holder keeps its file (and its lock) but the name is free: the next engine makes a
    new index and starts without the holder's records."""
    committed(shm_dir)
    holder = RegionIndex.open(str(shm_dir), ID, RECORDS)
    try:
        assert remove_index(str(shm_dir), ID) is True
        assert restored(shm_dir) == []
        holder.commit(1, KEY[::-1], (0, 0))  # writes go to the holder's own unnamed file
        assert restored(shm_dir) == []
    finally:
        holder.close()


def test_a_hard_linked_index_loses_only_its_own_name(shm_dir: Path) -> None:
    committed(shm_dir)
    other = shm_dir / "elsewhere"
    os.link(index_path(shm_dir), other)
    before = other.read_bytes()
    assert remove_index(str(shm_dir), ID) is True
    assert other.read_bytes() == before and os.stat(other).st_nlink == 1
    assert restored(shm_dir) == []


@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_what_is_no_regular_file_is_removed_never_followed_or_opened(
    shm_dir: Path, kind: str
) -> None:
    target = shm_dir / "target"
    target.write_bytes(b"keep")
    path = index_path(shm_dir)
    if kind == "symlink":
        path.symlink_to(target)
    else:
        os.mkfifo(path)
    assert remove_index(str(shm_dir), ID) is True
    assert not os.path.lexists(path) and target.read_bytes() == b"keep"


def test_a_directory_at_the_name_is_left_and_is_never_an_index(shm_dir: Path) -> None:
    index_path(shm_dir).mkdir()
    assert remove_index(str(shm_dir), ID) is False
    assert index_path(shm_dir).is_dir()
    with pytest.raises(IndexUnavailable):
        RegionIndex.open(str(shm_dir), ID, RECORDS)


def test_an_index_that_cannot_be_removed_is_said(shm_dir: Path) -> None:
    committed(shm_dir)
    path = index_path(shm_dir)
    subprocess.run(["chattr", "+i", str(path)], check=True)
    try:
        with pytest.raises(IndexUnavailable, match="cannot be removed"):
            remove_index(str(shm_dir), ID)
        assert path.exists()
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    assert restored(shm_dir) == [KEY]


def test_a_missing_directory_holds_no_index(shm_dir: Path) -> None:
    assert remove_index(str(shm_dir / "gone"), ID) is False
