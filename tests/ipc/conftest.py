from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


def _assert_nothing_left(directory: Path) -> None:
    leftovers = sorted(path.name for path in directory.iterdir())
    assert not leftovers, f"ring files left behind: {leftovers}"


@pytest.fixture
def ring_dir(tmp_path: Path) -> Iterator[str]:
    """A private directory for ring files; fails the test if a ring was left behind."""
    directory = tmp_path / "rings"
    directory.mkdir()
    yield str(directory)
    _assert_nothing_left(directory)


@pytest.fixture
def shm_ring_dir() -> Iterator[str]:
    """ring_dir on /dev/shm's tmpfs, where rings live in production (a region directory is
    one too)."""
    directory = Path(tempfile.mkdtemp(prefix="kvshm-test-ipc-", dir="/dev/shm"))
    try:
        yield str(directory)
        _assert_nothing_left(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
