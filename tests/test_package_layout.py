"""The package layout (docs/ARCHITECTURE.md, Components): source roots, no shadowed stdlib, no
torch in the agent or operator."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def find_python(version: str) -> str | None:
    """An interpreter of that version that runs (pyenv's shims exist for versions not enabled)."""
    candidates = sorted(Path.home().glob(f".pyenv/versions/{version}*/bin/python{version}"))
    found = shutil.which(f"python{version}")
    for candidate in [*map(str, candidates), *([found] if found else [])]:
        ok = subprocess.run([candidate, "-c", "pass"], capture_output=True, check=False)
        if ok.returncode == 0:
            return candidate
    return None


@pytest.mark.parametrize("version", ["3.11", "3.12"])
def test_stdlib_operator_is_not_shadowed_from_the_repo_root(version: str) -> None:
    interpreter = find_python(version)
    assert interpreter, f"no working python{version}: the machine this runs on must have it"
    result = subprocess.run(
        [interpreter, "-c", "import operator, typing; print(operator.__file__)"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert str(ROOT) not in result.stdout


def test_source_roots_hold_nothing_importable_directly() -> None:
    for root in ("agent", "operator"):
        assert not (ROOT / root / "__init__.py").exists()
        assert not (ROOT / root / "kvshm" / "__init__.py").exists()
        assert not list((ROOT / root).glob("*.py"))


def test_agent_and_operator_import_without_torch_or_numpy() -> None:
    code = (
        "import sys, kvshm.agent, kvshm.operator, kvshm.region, kvshm.ipc, kvshm.api;"
        "bad = {'torch', 'numpy'} & set(sys.modules); assert not bad, bad"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_every_package_is_typed() -> None:
    for root in ("agent", "operator"):
        for package in (ROOT / root / "kvshm").iterdir():
            if package.is_dir() and (package / "__init__.py").exists():
                assert (package / "py.typed").exists(), f"{package} lacks py.typed"


def test_agent_modules_fit_in_a_reading() -> None:
    # a reader takes a module in whole; one past this holds more than one job to split off
    longest = 420
    too_long = {
        str(path.relative_to(ROOT)): lines
        for path in (ROOT / "agent").rglob("*.py")
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > longest
    }
    assert not too_long, f"agent modules over {longest} lines: {too_long}"
