from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def ring_dir(tmp_path: Path) -> Iterator[str]:
    """A private directory for ring files; fails the test if a ring was left behind."""
    directory = tmp_path / "rings"
    directory.mkdir()
    yield str(directory)
    leftovers = sorted(path.name for path in directory.iterdir())
    assert not leftovers, f"ring files left behind: {leftovers}"
