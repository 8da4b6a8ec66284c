"""Tensor-parallel ranks as separate processes on one region (on one machine): both
ranks attach their cells and store at once; this process checks every stored byte of both
through vLLM's own region views; SIGKILL of one rank mid-transfer loses nothing the other
stored, and the agent still sees the other as a holder.

Each rank also loads what it stored back into other GPU blocks and compares them there. On a
GPU machine the same runs with CUDA tensors, both ranks on one GPU; on a machine with two GPUs,
each rank on its own GPU over a 4 GiB region (segmented into 1 GiB files, as vLLM 0.33 makes
it). bench/vllm_plugin/ranks.py measures each rank's GB/s alone and beside the other."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.source_roots import pythonpath
from tests.vllm_plugin.layouts import KvLayout, canonical_kv_caches
from tests.vllm_plugin.regions import agent_region, is_held, remove_region, vllm_views

REPO = Path(__file__).resolve().parents[2]
SHM = "/dev/shm"
WORKERS, CHUNKS, LAYERS, PAGE, GPU_BLOCKS = 2, 64, 4, 16 * 1024, 32
CELL = LAYERS * PAGE
GIB = 1 << 30


def start_rank(instance_id: str, rank: int, device: str, chunks: int, forever: bool = False) -> Any:
    args = [
        sys.executable,
        "-m",
        "tests.vllm_plugin.rank_process",
        SHM,
        instance_id,
        "--rank",
        str(rank),
        "--workers",
        str(WORKERS),
        "--chunks",
        str(chunks),
        "--layers",
        str(LAYERS),
        "--page",
        str(PAGE),
        "--gpu-blocks",
        str(GPU_BLOCKS),
        "--device",
        device,
    ] + (["--forever"] if forever else [])
    # keep the caller's path (vLLM may come from PYTHONPATH rather than the venv)
    env = {**os.environ, "PYTHONPATH": pythonpath(REPO, os.environ.get("PYTHONPATH", ""))}
    return subprocess.Popen(
        args, cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def stored_by(process: Any) -> list[dict[str, list[int]]]:
    loaded = 0
    for line in process.stdout:
        if line.startswith("LOADED "):
            loaded = int(line.split()[1])
        if line.startswith("STORED "):
            assert loaded > 0, "the rank stored but never loaded its pages back"
            return list(json.loads(line[len("STORED ") :]))
    raise AssertionError(f"rank process exited ({process.wait()}) before storing")


def check_rank(instance_id: str, rank: int, stored: list[dict[str, list[int]]], chunks: int) -> int:
    """Every stored page of the rank equals what that rank had on its GPU (regenerated)."""
    kv: Any = canonical_kv_caches(KvLayout("rank", LAYERS, PAGE), GPU_BLOCKS, "cpu", 100 + rank)
    pages = [PAGE] * LAYERS
    checked = 0
    with vllm_views(instance_id, chunks, rank, CELL * WORKERS, CELL, pages) as views:
        for job in stored:
            for block, chunk in zip(job["gpu"], job["cpu"], strict=True):
                for t, view in enumerate(views):
                    assert torch.equal(view[chunk], kv.tensors[t].tensor[block]), (
                        f"rank {rank}: chunk {chunk} tensor {t} is not GPU block {block}"
                    )
                    checked += 1
    return checked


def devices() -> list[Any]:
    two = pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
    )
    return [
        pytest.param(("cpu", "cpu"), CHUNKS, id="cpu"),
        pytest.param(("cuda:0", "cuda:0"), CHUNKS, id="one-gpu", marks=pytest.mark.gpu),
        pytest.param(
            ("cuda:0", "cuda:1"),
            4 * GIB // (CELL * WORKERS),
            id="two-gpus",
            marks=[pytest.mark.gpu, two],
        ),
    ]


@pytest.mark.parametrize(("device", "chunks"), devices())
def test_two_rank_processes_store_at_once_and_a_killed_one_costs_the_other_nothing(
    device: tuple[str, str], chunks: int
) -> None:
    instance_id = f"kvshm-ranks-{uuid.uuid4().hex[:8]}"
    path = agent_region(SHM, instance_id, chunks, CELL, WORKERS)
    ranks: list[Any] = []
    try:
        ranks = [
            start_rank(instance_id, 0, device[0], chunks),
            start_rank(instance_id, 1, device[1], chunks, forever=True),
        ]
        stored = [stored_by(p) for p in ranks]
        assert check_rank(instance_id, 0, stored[0], chunks) > 0
        assert check_rank(instance_id, 1, stored[1], chunks) > 0
        ranks[1].send_signal(signal.SIGKILL)  # while it keeps rewriting its cells
        assert ranks[1].wait(timeout=30) == -signal.SIGKILL
        assert is_held(path), "rank 0 still maps the region: the agent must see a holder"
        check_rank(instance_id, 0, stored[0], chunks)  # nothing rank 0 stored was lost
        check_rank(instance_id, 1, stored[1], chunks)  # its last complete bytes, rewritten same
        ranks[0].stdin.write("\n")
        ranks[0].stdin.flush()
        assert ranks[0].wait(timeout=30) == 0
        assert not is_held(path)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
                process.wait()
        remove_region(SHM, instance_id)  # every segment file
