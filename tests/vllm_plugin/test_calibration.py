"""kvshm_calibrate: each direction's backend measured once per host and layout, then cached.
On a CPU machine the only backend is memmove; a GPU machine measures dma, kernel and staged."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvshm.vllm import calibration
from kvshm.vllm.calibration import ChoiceCache, host_key, layout_key
from tests.vllm_plugin.checks import finish
from tests.vllm_plugin.conftest import Engine
from tests.vllm_plugin.engine import GPU_BLOCKS, TINY_LAYERS, TINY_PAGE
from tests.vllm_plugin.jobs import Job
from tests.vllm_plugin.layouts import KvLayout, canonical_kv_caches
from tests.vllm_plugin.test_plugin_cpu import region, spec_of  # noqa: F401  (fixture)


def test_the_choice_is_measured_once_then_read_from_the_cache(
    engine: Engine,
    region: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    timed: list[tuple[bool, str]] = []
    real = calibration._time_backend

    def counting(make: Any, gpu_to_cpu: bool, backend: str, *rest: Any) -> float:
        timed.append((gpu_to_cpu, backend))
        return real(make, gpu_to_cpu, backend, *rest)

    monkeypatch.setattr(calibration, "_time_backend", counting)
    kv = canonical_kv_caches(KvLayout("tiny", TINY_LAYERS, TINY_PAGE), GPU_BLOCKS, "cpu")
    for attempt in range(2):
        spec = spec_of(engine)
        spec.settings = dataclasses.replace(spec.settings, calibrate=True, cache_dir=str(tmp_path))
        worker = spec.get_worker(kv)
        job = Job([1, 2, 3], [4, 5], [3], [1])
        assert worker.submit_store(1, *job.specs())
        assert finish(worker, {1})[1].success
        assert worker.chosen_backends == {"store": "cpu", "load": "cpu"}
        worker.shutdown()
        if attempt == 0:
            assert sorted(timed) == [(False, "cpu"), (True, "cpu")]
    assert len(timed) == 2, "the second start measured again instead of reading the cache"
    saved = json.loads((tmp_path / "backend-choices.json").read_text())
    key = layout_key([TINY_PAGE] * TINY_LAYERS, 2)
    assert saved[host_key(kv.tensors[0].tensor.device)][key] == {"store": "cpu", "load": "cpu"}


def test_the_cache_keeps_other_layouts_and_survives_a_broken_file(tmp_path: Path) -> None:
    cache = ChoiceCache(tmp_path)
    cache.path.write_text("{not json")
    assert cache.get("host", "layout") is None
    cache.put("host", "a", {"store": "dma", "load": "kernel"})
    cache.put("host", "b", {"store": "staged", "load": "dma"})
    assert cache.get("host", "a") == {"store": "dma", "load": "kernel"}
    assert cache.get("other-host", "a") is None
    assert layout_key([65536] * 32, 1) == "32x65536B/bpc1"
