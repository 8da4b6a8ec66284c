"""The README's first command on a clone as a user has it: the repository's files alone in a
fresh directory, no ../shared beside it, no venv, no .tools. scripts/run-local.sh then installs
the agent's own dependencies only and runs the agent on examples/regions."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# what the test tooling or the serving pods need, and the main job must not install
NOT_FOR_THE_AGENT = ("torch", "vllm", "kopf", "pytest", "numpy", "mypy", "ruff")


def _clone(target: Path) -> None:
    """The working tree's files git knows (tracked, or untracked and not ignored): a clone."""
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-co", "--exclude-standard", "-z"],
        capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)


def _size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def test_the_main_job_runs_on_a_fresh_clone_with_the_agents_dependencies_only(
    tmp_path: Path, shm_dir: Path
) -> None:
    clone = tmp_path / "kvshm"
    clone.mkdir()
    _clone(clone)
    assert not (clone.parent / "shared").exists() and not (clone / ".tools").exists()
    venv = tmp_path / "venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "KVSHM_"))}
    env["KVSHM_VENV"] = str(venv)
    env["PATH"] = ":".join(p for p in env["PATH"].split(":") if ".venv" not in p)
    started = time.monotonic()
    done = subprocess.run(
        [str(clone / "scripts" / "run-local.sh"), "--once", "--root", str(shm_dir / "root"),
         "--port", "0"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    wall = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "demo" in done.stdout and "Ready" in done.stdout, done.stdout
    region = shm_dir / "root" / "default" / "demo" / "vllm_offload_demo-engine.mmap"
    assert region.stat().st_size == 2**30
    site = next(venv.glob("lib/python3*/site-packages"))
    installed = {p.name.split("-")[0].lower() for p in site.glob("*.dist-info")}
    assert not installed & set(NOT_FOR_THE_AGENT), installed & set(NOT_FOR_THE_AGENT)
    assert {"kubernetes", "prometheus_client", "pyyaml"} <= installed, installed
    assert not (clone / ".tools").exists()  # no test tooling was set up
    print(f"main job on a fresh clone: {wall:.1f} s, venv {_size_mib(venv):.0f} MiB")
