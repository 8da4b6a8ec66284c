"""The benchmarks still run: every script prints its usage, every shared module imports, the
CPU benchmarks finish a tiny run, and on a GPU machine the transfer benchmark does too.
Nothing else runs them in CI, so this is what keeps them from rotting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
SCRIPTS = sorted(p for p in BENCH.rglob("*.py") if '__name__ == "__main__"' in p.read_text())
SHARED_MODULES = sorted(set(BENCH.rglob("*.py")) - set(SCRIPTS))


def name_of(path: Path) -> str:
    return str(path.relative_to(BENCH))


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """A benchmark's command line, from the repository root, as its docstring says to run it
    (with what PYTHONPATH already holds after that: vLLM, where it is a source tree)."""
    roots = [str(REPO / root) for root in ("agent", "operator")]
    path = os.pathsep.join([*roots, *filter(None, [os.environ.get("PYTHONPATH")])])
    return subprocess.run(
        [sys.executable, *args],
        cwd=REPO,
        env=os.environ | {"PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_bench_tree_has_scripts_and_shared_modules() -> None:
    # the globs above found what they are meant to (an empty parametrization would pass)
    assert {"transfer/bench_transfer.py", "populate/run.py"} <= {name_of(p) for p in SCRIPTS}
    assert "common/gpu.py" in {name_of(p) for p in SHARED_MODULES}


@pytest.mark.parametrize("script", SCRIPTS, ids=name_of)
def test_each_benchmark_prints_its_usage(script: Path) -> None:
    result = run(str(script), "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:")


@pytest.mark.parametrize("module", SHARED_MODULES, ids=name_of)
def test_each_shared_module_imports(module: Path) -> None:
    name = ".".join(module.relative_to(REPO).with_suffix("").parts)
    result = run("-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); import {name}")
    assert result.returncode == 0, result.stderr


def tiny_cpu_runs(directory: Path) -> dict[str, tuple[list[str], str]]:
    """Per CPU benchmark: arguments for a run of a few seconds, and a line its table prints."""
    where = ["--directory", str(directory)]
    pages = ["--compare-pages", *where]
    idle = ["--idle-regions", "2", "--idle-region-mib", "8", "--idle-seconds", "1"]
    tiny_warm_restart = ["--chunks", "200", "--requests", "300", "--rounds", "1"]
    tiny_warm_restart += ["--restore-chunks", "100"]
    warm_gpu_flow = ["--device", "cpu", "--chunks", "16", "--rounds", "1"]
    tiny_weights = ["--make-gib", "8", "--tiny", "--remove", "--rounds", "1"]
    return {
        "ipc": (["bench/ipc/run.py", "--quick", "--cases", "64x1", "--repeat", "1"], "kvshm"),
        "agent": (
            ["bench/agent/run.py", "--sizes-gib", "0.0625", "--repeat", "1", *where, *idle],
            "RSS private",
        ),
        "populate": (
            ["bench/populate/run.py", "--gib", "0.25", "--tp", "2", "--repeat", "1", *where],
            "kvshm agent",
        ),
        "attach": (
            ["bench/attach/run.py", "--quick", "--gib", "0.25", "--tp", "1", "2", *where],
            "kvshm attach of the agent's region",
        ),
        "warm_restart": (
            ["bench/warm_restart/run.py", *tiny_warm_restart, *where],
            "kvshm/vLLM",
        ),
        # the GPU comparison's flow, on the CPU (kvshm's worker stands in for vLLM's)
        "warm_restart-gpu-flow": (
            ["bench/warm_restart/gpu.py", *warm_gpu_flow, *where],
            "fs / kvshm",
        ),
        # a tmpfs: no cold figure, but the whole flow on a model a thousandth of 8 GiB
        "warm_restart-weights": (
            ["bench/warm_restart/weights_digest.py", *tiny_weights, *where],
            "sampled digest",
        ),
        # huge pages against 4 KiB ones: a huge-page tmpfs mounted for the run
        "attach-pages": (
            ["bench/attach/run.py", "--quick", "--gib", "0.25", "--tp", "2", *pages],
            "open->ready, 4 KiB / 2 MiB pages",
        ),
        "plugin-pages": (
            ["bench/vllm_plugin/pages.py", "--quick", "--layouts", "2mib-blocks", *where],
            "2M/4K",
        ),
    }


@pytest.mark.parametrize(
    "bench",
    [
        "ipc",
        "agent",
        "populate",
        "attach",
        "attach-pages",
        "plugin-pages",
        "warm_restart",
        "warm_restart-gpu-flow",
        "warm_restart-weights",
    ],
)
def test_each_cpu_benchmark_finishes_a_tiny_run_and_leaves_nothing(
    bench: str, shm_dir: Path
) -> None:
    args, printed = tiny_cpu_runs(shm_dir)[bench]
    result = run(*args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert printed in result.stdout
    assert list(shm_dir.iterdir()) == []


@pytest.mark.gpu
def test_the_transfer_benchmark_finishes_a_tiny_run(shm_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    args = ["--sizes", "64", "--layers", "0", "--reps", "1", "--pass-mib", "256"]
    result = run(
        "bench/transfer/bench_transfer.py", *args, "--json", str(out), "--dir", str(shm_dir)
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    figures = json.loads(out.read_text())
    assert [row["dir"] for row in figures["two"]] == ["H2D", "D2H", "both"]
    assert all(row["kvshm"] > 0 for row in figures["two"])
    assert len(figures["goals"]) == 2
    assert list(shm_dir.iterdir()) == []


@pytest.mark.gpu
def test_the_registration_cost_benchmark_takes_registration_apart(
    shm_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "registration.json"
    args = ["--gib", "0.25", "--ranks", "2", "--directory", str(shm_dir), "--json", str(out)]
    result = run("bench/attach/registration_cost.py", *args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    figures = json.loads(out.read_text())
    for pages in ("4 KiB", "2 MiB"):
        one = figures[pages]["one"]
        assert one["cells"]["calls"] == one["rows"]["calls"] == 51  # 0.25 GiB of 5 MiB rows
        assert one["whole"]["calls"] == 1
        assert one["window"]["register_s"] > 0  # rank 0's cells back to back, one call
        assert len(figures[pages]["concurrent"]) == 2
    assert "µs a MiB" in result.stdout
    assert list(shm_dir.iterdir()) == []
    assert "kvshm-bench-huge-" not in Path("/proc/self/mountinfo").read_text()


@pytest.mark.gpu
@pytest.mark.parametrize("reader", ["proxy", "auto"])
def test_the_attention_layout_benchmark_finishes_a_tiny_run(reader: str, tmp_path: Path) -> None:
    from bench.vllm_plugin.attention_layout import QUERY_HEADS, flash_attention

    out = tmp_path / "attention.json"
    args = ["--cache-gib", "0.5", "--seqs", "2", "--context", "256", "--steps", "1"]
    result = run(
        "bench/vllm_plugin/attention_layout.py", *args, "--rounds", "1", "--reader", reader,
        "--json", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    figures = json.loads(out.read_text())
    runs_here = not isinstance(flash_attention(), str)
    assert figures["reader"] == ("flash-attention" if reader == "auto" and runs_here else "proxy")
    assert [row["model"] for row in figures["models"]] == list(QUERY_HEADS)
    assert all(row["ratio"] > 0 for row in figures["models"])


def test_the_populate_benchmark_compares_huge_pages_with_4_kib_ones(shm_dir: Path) -> None:
    args, _ = tiny_cpu_runs(shm_dir)["populate"]
    result = run(*args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = {line.split(",")[1].strip(): line for line in result.stdout.splitlines()
            if line.strip().startswith("kvshm agent,")}  # fmt: skip
    assert set(rows) == {"4 KiB pages", "2 MiB pages"}
    assert rows["2 MiB pages"].rstrip().endswith("100%")  # every byte of it on huge pages
    assert rows["4 KiB pages"].rstrip().endswith(" 0%")
    assert "goal (issue 35): kvshm agent on 2 MiB pages >= 2.5x" in result.stdout
    assert "kvshm-bench-huge-" not in Path("/proc/self/mountinfo").read_text()  # unmounted
