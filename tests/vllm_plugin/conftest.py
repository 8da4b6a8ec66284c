"""tests/vllm_plugin: kvshm's vLLM 0.33 plugin against vLLM's own code (installed with --no-deps).

vLLM picks its platform at import: these tests parse engine flags with the CPU platform (on
the GPU machine too: only the KV tensors live on the GPU there).
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import dataclasses
import uuid
from typing import Any

import pytest

from tests.vllm_plugin.engine import (
    BLOCKS_PER_CHUNK,
    CPU_PAGE,
    NUM_CHUNKS,
    kv_transfer_config,
    vllm_config,
    write_model,
)


@dataclasses.dataclass
class Engine:
    engine_id: str
    config: Any


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """One engine's VllmConfig, from its flags (slow: vLLM's config code runs once)."""
    engine_id = f"kvshm-plugin-test-{uuid.uuid4().hex[:8]}"
    flags = kv_transfer_config(
        engine_id,
        {"cpu_bytes_to_use": NUM_CHUNKS * CPU_PAGE, "blocks_per_chunk": BLOCKS_PER_CHUNK},
    )
    return Engine(engine_id, vllm_config(write_model(tmp_path_factory.mktemp("model")), flags))


@pytest.fixture(autouse=True)
def calibration_cache_home(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin measures its copy backends by default and caches the choice under
    $XDG_CACHE_HOME: each test gets its own, so none reads another's choice or writes to ~."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture
def measurements(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every kvshm.transfer.calibration Measurement the plugin takes in the test, in order."""
    from kvshm.transfer.calibration import calibrate

    measured: list[Any] = []
    real = calibrate.measure

    def keeping(*args: Any, **kwargs: Any) -> Any:
        measured.append(real(*args, **kwargs))
        return measured[-1]

    monkeypatch.setattr(calibrate, "measure", keeping)
    return measured
