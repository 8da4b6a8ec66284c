"""A real vLLM 0.33 engine (the offline LLMEngine: its scheduler, the V2 model runner, Triton
attention, dummy weights) with kvshm's plugin on a region the agent made: a CPU-tier hit, the
outputs of an engine without a tier, a restarted engine that hits, and a drain followed.

Each engine runs in a process of its own (bench/engine/engine.py, which registers stand-ins for
the few compiled vLLM ops it calls where vLLM's extension cannot load). Importing this module
needs nothing of vLLM's or CUDA's: on a machine without CUDA every test is skipped as a GPU
test."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from bench.engine.run import GIB, agent_region, engine_process, region_bytes, region_layout
from bench.engine.shapes import LLAMA_TINY

pytestmark = pytest.mark.gpu

ROOT = Path("/dev/shm/kvshm-engine-tests")
PREFIX = 4096  # tokens: 256 blocks
BLOCK = 16
PROBE = {"prefix_tokens": PREFIX, "prefixes": 1, "repeats": 1}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return LLAMA_TINY.write(tmp_path / "model")


@pytest.fixture
def region(model_dir: Path) -> Iterator[dict[str, Any]]:
    """An agent-made region of 1 GiB for the tiny model: its id, directory and bytes."""
    engine_id = f"gpu-test-{uuid.uuid4().hex[:8]}"
    document = region_layout(model_dir, engine_id, GIB)
    directory, _ = agent_region(document, ROOT)
    try:
        yield {
            "engine_id": engine_id,
            "region_dir": str(directory),
            "cpu_bytes": region_bytes(document),
        }
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def spec(model_dir: Path, tier: str, **more: Any) -> dict[str, Any]:
    return {
        "label": f"test-{tier}",
        "tier": tier,
        "shape": LLAMA_TINY.name,
        "model_dir": str(model_dir),
        "gpu_kv_bytes": 256 << 20,
        "max_model_len": 8192,
        "engine_id": f"gpu-test-{tier}-{uuid.uuid4().hex[:6]}",
        **more,
    }


def start(tmp_path: Path, engine: dict[str, Any]) -> tuple[subprocess.Popen[str], Path]:
    name = f"{engine['label']}-{uuid.uuid4().hex[:6]}"
    spec_path, result = tmp_path / f"{name}.spec.json", tmp_path / f"{name}.result.json"
    spec_path.write_text(json.dumps(engine))
    return engine_process(spec_path, result), result


def run(tmp_path: Path, engine: dict[str, Any], timeout: float = 240) -> dict[str, Any]:
    process, result = start(tmp_path, engine)
    output, _ = process.communicate(timeout=timeout)
    assert result.exists(), output[-4000:]
    found: dict[str, Any] = json.loads(result.read_text())
    assert found["ok"], found.get("error") or output[-4000:]
    return found


def test_a_cpu_tier_hit_gives_the_outputs_of_an_engine_without_a_tier(
    tmp_path: Path, model_dir: Path, region: dict[str, Any]
) -> None:
    without = run(tmp_path, spec(model_dir, "a", probe=PROBE))
    plugin = run(tmp_path, spec(model_dir, "c", probe=PROBE) | region)
    (row,) = plugin["probe"]["rows"]
    (hit,) = row["tier_hits"]
    # every whole block of the prompt but the last (vLLM computes at least one token)
    assert hit["external_tokens"] >= PREFIX - BLOCK, hit
    assert hit["load_bytes"] >= (PREFIX - BLOCK) * LLAMA_TINY.kv_bytes_per_token, hit
    assert row["outputs_equal"], "a CPU-tier load changed the greedy tokens"
    assert row["output"] == without["probe"]["rows"][0]["output"]


def test_a_restarted_engine_hits_what_the_first_stored(
    tmp_path: Path, model_dir: Path, region: dict[str, Any]
) -> None:
    first = run(tmp_path, spec(model_dir, "c", probe=PROBE, warmup=False) | region)
    second = run(tmp_path, spec(model_dir, "c", probe=PROBE, warmup=False) | region)
    (before,) = first["probe"]["rows"]
    (after,) = second["probe"]["rows"]
    assert before["cold"]["external_tokens"] == 0
    # the new process's first request of the prompt loads it from the region
    assert after["cold"]["external_tokens"] >= PREFIX - BLOCK, after["cold"]
    assert after["output"] == before["output"]


def test_a_drain_event_is_followed(tmp_path: Path, model_dir: Path, region: dict[str, Any]) -> None:
    from kvshm.agent.drain.notify import CHUNK_BYTES, CHUNKS, EVENTS_RING
    from kvshm.ipc import MessageQueue, WaitPolicy
    from kvshm.region.drain_event import DrainEvent
    from tests.vllm_plugin.regions import is_held

    events = MessageQueue(
        2,
        CHUNK_BYTES,
        CHUNKS,
        name=EVENTS_RING,
        directory=region["region_dir"],
        wait_policy=WaitPolicy(spin_seconds=0.0, max_sleep_seconds=0.01),
        on_dead_reader="evict",
    )
    try:
        engine = spec(model_dir, "c", serve_until_drained=120) | region
        process, result = start(tmp_path, engine)
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line)
            if "drain: serving" in line:
                break
        region_file = os.path.join(region["region_dir"], f"vllm_offload_{region['engine_id']}.mmap")
        assert is_held(region_file), "the serving engine holds its region"
        event = DrainEvent("default/test", region["engine_id"], "region deleted", time.time() + 30)
        events.enqueue(event.to_message(), timeout=5.0)
        output, _ = process.communicate(timeout=120)
        found = json.loads(result.read_text())
        drain = found.get("drain") or {}
        assert drain.get("error") and "drained" in drain["error"], ("".join(lines) + output)[-4000:]
        assert not is_held(region_file)
    finally:
        events.close()
