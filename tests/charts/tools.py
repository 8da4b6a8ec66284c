"""Where the chart lives and how the tests find the tools scripts/install-tools.sh installs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "kvshm"
TOOLS = REPO / ".tools"


def tool(name: str) -> str:
    """The path of a tool from .tools/bin (or PATH); a missing tool fails the test, never skips."""
    local = TOOLS / "bin" / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run scripts/install-tools.sh (scripts/test.sh does)")
    return found


def run(
    *args: str, input: str | None = None, timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a command; the result carries stdout and stderr for assertions and messages."""
    return subprocess.run(
        args, input=input, capture_output=True, text=True, timeout=timeout, check=False, cwd=cwd
    )
