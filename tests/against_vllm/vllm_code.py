"""Running vLLM's own code from the tests: a subprocess of the test venv's Python with vLLM 0.33
(or 0.32's unpacked sources first on sys.path) and no CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
VLLM_032_TREE = Path(sys.prefix) / "vllm-0.32.0"


def vllm_env(release: str = "0.33.0") -> dict[str, str]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(
        [*([str(VLLM_032_TREE)] if release == "0.32.0" else []), str(HERE.parents[1])]
    )
    return env


def run_vllm_script(
    script: str, *args: str, release: str = "0.33.0", timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HERE / script), *args],
        env=vllm_env(release),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def offload_geometry(
    cases: list[dict[str, Any]], release: str = "0.33.0"
) -> list[list[dict[str, Any]]]:
    """vLLM's CPUOffloadingSpec geometry for each (model directory, serve args) case."""
    done = run_vllm_script("offload_geometry.py", json.dumps(cases), release=release)
    assert done.returncode == 0, done.stderr[-4000:]
    result: list[list[dict[str, Any]]] = json.loads(done.stdout.strip().splitlines()[-1])
    return result
