from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from kvshm.ipc import RingLayout, ShmRingBuffer
from kvshm.ipc.errors import RingConfigError, RingFormatError
from kvshm.ipc.ringfile import RingFile, check_name
from kvshm.region.errors import UnsafePathError


def test_created_file_is_owner_only_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        ring = RingFile.create(str(tmp_path), "events", 8192)
    finally:
        os.umask(old)
    try:
        st = os.stat(tmp_path / "events")
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_size == 8192
        assert st.st_blocks * 512 >= 8192  # pages allocated up front, not on first touch
        assert ring.mapping[:] == bytes(8192)
    finally:
        ring.close()


def test_group_mode_and_owner_are_applied(tmp_path: Path) -> None:
    ring = RingFile.create(str(tmp_path), "events", 4096, file_mode=0o660, owner=(1234, 5678))
    try:
        st = os.stat(tmp_path / "events")
        assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o660, 1234, 5678)
    finally:
        ring.close()


@pytest.mark.parametrize("mode", [0o644, 0o606, 0o1777, -1])
def test_modes_that_open_the_ring_to_everyone_are_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(RingConfigError, match="mode"):
        RingFile.create(str(tmp_path), "events", 4096, file_mode=mode)
    assert not (tmp_path / "events").exists()


@pytest.mark.parametrize("name", ["", "../x", "a/b", ".hidden", "a..b", "x" * 201, "é"])
def test_names_that_are_not_one_plain_file_name_are_refused(name: str) -> None:
    with pytest.raises(RingConfigError, match="ring name"):
        check_name(name)


def test_an_existing_file_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "events").write_bytes(b"keep me")
    with pytest.raises(FileExistsError, match="resume its writer"):
        RingFile.create(str(tmp_path), "events", 4096)
    assert (tmp_path / "events").read_bytes() == b"keep me"


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"x" * 4096)
    (tmp_path / "events").symlink_to(target)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        RingFile.open(str(tmp_path), "events")
    with pytest.raises(FileExistsError):
        RingFile.create(str(tmp_path), "events", 4096)
    assert target.read_bytes() == b"x" * 4096


def test_a_fifo_is_not_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "events")
    with pytest.raises(UnsafePathError, match="FIFO"):
        RingFile.open(str(tmp_path), "events")


def test_an_empty_file_reads_as_not_ready(tmp_path: Path) -> None:
    (tmp_path / "events").touch()
    assert RingFile.open(str(tmp_path), "events") is None


def test_unlink_leaves_a_replacement_alone(tmp_path: Path) -> None:
    ring = RingFile.create(str(tmp_path), "events", 4096)
    os.unlink(tmp_path / "events")
    (tmp_path / "events").write_bytes(b"someone else's")
    ring.unlink()
    ring.close()
    assert (tmp_path / "events").read_bytes() == b"someone else's"


def test_reopen_gives_the_same_file_even_after_unlink(tmp_path: Path) -> None:
    ring = RingFile.create(str(tmp_path), "events", 4096)
    try:
        ring.unlink()
        fd = ring.reopen()
        try:
            os.pwrite(fd, b"seen", 0)
            assert ring.mapping[:4] == b"seen"
        finally:
            os.close(fd)
    finally:
        ring.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_file_shrunk_while_its_trailer_is_read_is_a_format_error(
    shm_ring_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with ShmRingBuffer(1, 4096, 2, name="events", directory=shm_ring_dir, create=True) as ring:
        real_pread = os.pread

        def tenant_shrinks_it_first(fd: int, length: int, offset: int) -> bytes:
            os.truncate(ring.path, offset + 10)  # between the size check and the read
            return real_pread(fd, length, offset)

        monkeypatch.setattr(os, "pread", tenant_shrinks_it_first)
        before = open_fds()
        with pytest.raises(RingFormatError, match=r"shrank from .* while its trailer was read"):
            RingFile.open(shm_ring_dir, "events")
        assert open_fds() == before


def test_a_file_shrunk_before_it_is_mapped_is_a_format_error(shm_ring_dir: str) -> None:
    with ShmRingBuffer(1, 4096, 2, name="events", directory=shm_ring_dir, create=True) as ring:

        def tenant_shrinks_it_meanwhile(layout: RingLayout) -> bool:
            os.truncate(ring.path, layout.total_bytes // 2)  # after the checks, before mmap
            return True

        before = open_fds()
        with pytest.raises(RingFormatError, match=r"shrank below the .* bytes of its ring"):
            ShmRingBuffer.attach(ring.path, attach_timeout=0, accept=tenant_shrinks_it_meanwhile)
        assert open_fds() == before
