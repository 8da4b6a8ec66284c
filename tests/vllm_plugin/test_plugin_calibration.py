"""kvshm_calibrate (on by default): the store and load backends measured once per host and
layout, one way and both ways at once, then cached. On a CPU machine the only backend is
memmove; a GPU machine measures dma, kernel and staged (tests/vllm_plugin/test_plugin_gpu.py).
The calibration itself: tests/transfer/test_calibration.py and test_choice_cache.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from kvshm.transfer.calibration import CHOICES, Measurement
from kvshm.transfer.calibration.cache import host_key, layout_key
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
    measurements: list[Measurement],
) -> None:
    kv = canonical_kv_caches(KvLayout("tiny", TINY_LAYERS, TINY_PAGE), GPU_BLOCKS, "cpu")
    for attempt in range(2):
        spec = spec_of(engine)
        assert spec.settings.calibrate, "calibration is on by default"
        spec.settings = dataclasses.replace(spec.settings, cache_dir=str(tmp_path))
        worker = spec.get_worker(kv)
        job = Job([1, 2, 3], [4, 5], [3], [1])
        assert worker.submit_store(1, *job.specs())
        assert finish(worker, {1})[1].success
        assert worker.chosen_backends == dict.fromkeys(CHOICES, "cpu")
        worker.shutdown()
        if attempt == 0:
            (first,) = measurements
            assert set(first.alone) == {"store", "load"}
            assert set(first.both) == {("cpu", "cpu")}
            assert all(0 < t < float("inf") for t in first.alone["store"].values())
    assert len(measurements) == 1, "the second start measured again instead of reading the cache"
    saved = json.loads((tmp_path / "backend-choices.json").read_text())
    # vLLM 0.33's layer-outer cache: the layers' views of one allocation
    key = layout_key([TINY_PAGE] * TINY_LAYERS, 2, one_allocation=True)
    assert saved[host_key(worker.gpu_tensors[0].device)][key] == dict.fromkeys(CHOICES, "cpu")


@pytest.mark.parametrize("calibrate", [True, False])
def test_copy_engines_chooses_among_the_backends_that_leave_the_sms_alone(
    engine: Engine,
    region: str,  # noqa: F811
    tmp_path: Path,
    calibrate: bool,
) -> None:
    """kvshm_backend: copy-engines. On a CPU machine memmove is the one such backend; the
    choice is kept under a key of its own, apart from the unrestricted one."""
    from kvshm.vllm.settings import PluginSettings

    kv = canonical_kv_caches(KvLayout("tiny", TINY_LAYERS, TINY_PAGE), GPU_BLOCKS, "cpu")
    spec = spec_of(engine)
    extra = {"kvshm_backend": "copy-engines", "kvshm_calibrate": calibrate}
    settings = PluginSettings.from_extra_config(extra, engine.engine_id, 0, 1)
    assert settings.backend == "copy-engines"
    spec.settings = dataclasses.replace(settings, cache_dir=str(tmp_path))
    worker = spec.get_worker(kv)
    job = Job([1, 2, 3], [4, 5], [3], [1])
    assert worker.submit_store(1, *job.specs())
    assert finish(worker, {1})[1].success
    handlers = ("store", "load", "expedited_load")
    assert worker.handler_backends() == {name: ["cpu"] for name in handlers}
    worker.shutdown()
    saved = tmp_path / "backend-choices.json"
    if not calibrate:
        assert worker.chosen_backends == {} and not saved.exists()
        return
    assert worker.chosen_backends == dict.fromkeys(CHOICES, "cpu")
    key = layout_key([TINY_PAGE] * TINY_LAYERS, 2, sm_free=True, one_allocation=True)
    unrestricted = layout_key([TINY_PAGE] * TINY_LAYERS, 2, one_allocation=True)
    assert key.endswith("/copy-engines") and key != unrestricted
    (choices,) = json.loads(saved.read_text()).values()
    assert list(choices) == [key]
