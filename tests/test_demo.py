"""`kvshm demo`: the README's local run, end to end in real processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshm.cli", "demo", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_demo_from_yaml_creates_populates_locks_and_attaches_every_worker(shm_dir: Path) -> None:
    result = run_demo(
        str(ROOT / "examples/regions/demo.yaml"), "--blocks", "256", "--directory", str(shm_dir)
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "256 rows of 4 cells of 65536 bytes (vllm-0.33: 262144-byte rows, 1 file)" in out
    assert "populated 0.06 GiB" in out and "resident 0.06 GiB" in out
    assert "locked in memory" in out
    assert out.count("wrote its own: ok") == 4
    assert "done: every worker saw the agent's bytes" in out
    assert list(shm_dir.iterdir()) == []  # removed at the end


def test_demo_keep_leaves_the_file(shm_dir: Path) -> None:
    result = run_demo(
        "--blocks",
        "8",
        "--workers",
        "2",
        "--instance-id",
        "kept",
        "--directory",
        str(shm_dir),
        "--keep",
    )
    assert result.returncode == 0, result.stderr
    assert (shm_dir / "vllm_offload_kept.mmap").stat().st_size == 8 * 2 * 65536


def test_demo_refuses_a_bad_spec_with_the_field_named(shm_dir: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "kind: OffloadRegion\nmetadata: {name: bad}\n"
        "spec: {layout: {numBlocks: 4, cpuPageSize: 4096}, access: {mode: 0644}}\n"
    )
    result = run_demo(str(bad), "--directory", str(shm_dir))
    assert result.returncode != 0
    assert "spec.access.mode" in result.stderr and "other users" in result.stderr
    assert list(shm_dir.iterdir()) == []


def test_demo_refuses_an_existing_region_without_touching_it(shm_dir: Path) -> None:
    existing = shm_dir / "vllm_offload_demo.mmap"
    existing.write_bytes(b"mine")
    result = run_demo("--blocks", "4", "--directory", str(shm_dir))
    assert result.returncode == 1
    assert "already exists" in result.stderr
    assert existing.read_bytes() == b"mine"
