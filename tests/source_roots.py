"""kvshm's source roots, one per runtime (docs/ARCHITECTURE.md, Components), as pyproject.toml
lists them for the editable install: for tests that start a Python of their own without it."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = tuple(
    REPO / name
    for name in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["hatch"]["build"][
        "dev-mode-dirs"
    ]
)


def pythonpath(*extra: str | Path) -> str:
    """PYTHONPATH for a child Python: every source root, then extra."""
    return os.pathsep.join([*map(str, SOURCE_ROOTS), *map(str, extra)])
