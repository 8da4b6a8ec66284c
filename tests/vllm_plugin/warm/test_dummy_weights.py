"""An engine with vLLM's dummy weights (`--load-format dummy`: no weight files, every weight
drawn from a fixed seed, as benchmarks run) keeps its region's index across a restart without
a label of its weights, and never serves, or is served by, the index of real weights."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvshm.region.naming import index_file_name
from tests.vllm_plugin.engine import (
    BLOCKS_PER_CHUNK,
    CPU_PAGE,
    kv_transfer_config,
    vllm_config,
    write_model,
)
from tests.vllm_plugin.regions import agent_region, remove_region
from tests.vllm_plugin.warm.test_warm_restart import (
    CHUNKS,
    SHM,
    lookup_all,
    scheduler_manager,
    sha256_hashing,  # noqa: F401 (a fixture)
    store_some,
)


@pytest.fixture
def engine_id() -> Iterator[str]:
    engine_id = f"kvshm-dummy-{uuid.uuid4().hex[:8]}"
    agent_region(SHM, engine_id, CHUNKS, CPU_PAGE, 1)
    try:
        yield engine_id
    finally:
        remove_region(SHM, engine_id)
        (Path(SHM) / index_file_name(engine_id)).unlink(missing_ok=True)


def config(model_dir: Path, engine_id: str, *flags: str) -> Any:
    transfer = kv_transfer_config(
        engine_id,
        {
            "cpu_bytes_to_use": CHUNKS * CPU_PAGE,
            "blocks_per_chunk": BLOCKS_PER_CHUNK,
            "kvshm_region_dir": SHM,
            "kvshm_calibrate": False,
            "kvshm_pin": False,
        },
    )
    return vllm_config(model_dir, transfer, *flags)


@pytest.mark.usefixtures("sha256_hashing")
def test_dummy_weights_restart_warm_without_a_label(tmp_path: Path, engine_id: str) -> None:
    model_dir = write_model(tmp_path / "model")  # config.json only: no weight files
    old = scheduler_manager(config(model_dir, engine_id, "--load-format", "dummy"))
    keys = store_some(old)
    assert old.warm_outcome.reason == "a new index: no engine wrote it yet"
    old.shutdown()
    new = scheduler_manager(config(model_dir, engine_id, "--load-format", "dummy"))
    assert lookup_all(new, keys) == len(keys)
    assert new.warm_outcome.state == "warm"
    new.shutdown()


@pytest.mark.usefixtures("sha256_hashing")
def test_real_weights_never_hit_a_dummy_engines_chunks(tmp_path: Path, engine_id: str) -> None:
    model_dir = write_model(tmp_path / "model")
    old = scheduler_manager(config(model_dir, engine_id, "--load-format", "dummy"))
    keys = store_some(old)
    old.shutdown()
    (model_dir / "model.safetensors").write_bytes(b"trained weights")
    real = scheduler_manager(config(model_dir, engine_id))
    assert lookup_all(real, keys) == 0
    assert real.warm_outcome.state == "cold"
    real.shutdown()
