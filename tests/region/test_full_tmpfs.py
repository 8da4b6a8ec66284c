"""A tmpfs that cannot hold a region: clear errors with sizes, no partial files, no SIGBUS.

Runs on a real 64 MiB tmpfs mounted for each test.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvshm.region import RegionLayout, RegionSpaceError, SharedOffloadRegion

MIB = 1024 * 1024


def region(directory: Path, name: str, mib: int, **kwargs: object) -> SharedOffloadRegion:
    return SharedOffloadRegion(
        name,
        RegionLayout(mib, MIB, 1),
        directory=str(directory),
        **kwargs,  # type: ignore[arg-type]
    )


def test_region_larger_than_the_tmpfs_is_refused_before_creating(small_tmpfs: Path) -> None:
    with pytest.raises(RegionSpaceError, match=r"needs 104857600 bytes but its filesystem has \d+"):
        region(small_tmpfs, "big", 100)
    assert list(small_tmpfs.iterdir()) == []


def test_attacher_populating_a_full_tmpfs_gets_an_error_not_sigbus(small_tmpfs: Path) -> None:
    with region(small_tmpfs, "sparse", 48, populate=False) as creator:
        (small_tmpfs / "filler").write_bytes(b"\1" * (40 * MIB))
        with pytest.raises(RegionSpaceError, match="while populating at offset"):
            region(small_tmpfs, "sparse", 48, populate=True)
        # an attacher never removes the creator's file
        assert Path(creator.mmap_path).exists()


def test_creators_racing_for_too_little_space_fail_cleanly(small_tmpfs: Path) -> None:
    """48 + 32 MiB on 64 MiB: at least one must fail, each failure is a RegionSpaceError,
    and a creator that failed leaves no partial file behind."""
    first = region(small_tmpfs, "first", 48, populate=False)
    errors: list[BaseException] = []

    def populate_first() -> None:
        try:
            first.populate()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=populate_first)
    thread.start()
    second: SharedOffloadRegion | None = None
    try:
        second = region(small_tmpfs, "second", 32)
    except BaseException as exc:
        errors.append(exc)
    thread.join()
    try:
        assert errors, "80 MiB fitted in a 64 MiB tmpfs?"
        assert all(isinstance(exc, RegionSpaceError) for exc in errors), errors
        second_path = small_tmpfs / "vllm_offload_second.mmap"
        assert second_path.exists() == (second is not None)
    finally:
        first.cleanup()
        if second is not None:
            second.cleanup()
    assert list(small_tmpfs.iterdir()) == []
