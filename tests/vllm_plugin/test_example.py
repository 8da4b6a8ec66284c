"""examples/serving/plugin: its flags, parsed by vLLM's own EngineArgs for the model it serves,
load the plugin with the region's geometry, directory and instance id."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.vllm_plugin.engine import kv_cache_config, offloading_spec, vllm_config

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "serving" / "plugin" / "deployment.yaml"
# Llama-3.1-70B's shape (its config.json, without weights)
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 80,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
# the OffloadRegion layout the example says it serves (`kvshm layout` for this model, TP 4)
REGION = {"numBlocks": 13107, "cpuPageSize": 1310720, "numWorkers": 4}


def container(document: dict[str, Any]) -> dict[str, Any]:
    return dict(document["spec"]["template"]["spec"]["containers"][0])


def env_of(document: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value") for e in container(document)["env"]}


def test_the_example_attaches_its_region_with_vllms_geometry(tmp_path: Path) -> None:
    deployment = yaml.safe_load(EXAMPLE.read_text())
    vllm = container(deployment)
    env = env_of(deployment)
    flags = json.loads(env["KV_TRANSFER_CONFIG"])
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    config = vllm_config(tmp_path, env["KV_TRANSFER_CONFIG"], "--tensor-parallel-size=4")
    assert config.parallel_config.world_size == 4
    # rank 0's KV cache: 80 layers of 8 / 4 KV heads
    spec = offloading_spec(
        config, 1024, kv_cache_config(1024, layers=80, kv_heads=2, head_size=128)
    )
    geometry = spec.region_geometry
    assert (geometry.num_chunks, geometry.cpu_page_size, geometry.num_workers) == (
        REGION["numBlocks"],
        REGION["cpuPageSize"],
        REGION["numWorkers"],
    )
    assert geometry.size_bytes == flags["kv_connector_extra_config"]["cpu_bytes_to_use"]
    assert spec.settings.instance_id == flags["engine_id"]
    mounts = {m["name"]: m["mountPath"] for m in vllm["volumeMounts"]}
    assert spec.settings.region_dir == mounts["kv-region"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    region_dir = volumes["kv-region"]["hostPath"]["path"]
    assert region_dir.endswith(f"/{deployment['metadata']['namespace']}/{flags['engine_id']}")
    assert env["PROMETHEUS_MULTIPROC_DIR"] == mounts["metrics"]
    assert spec.settings.cache_dir == mounts["backend-choices"]  # measured once per pod


@pytest.mark.parametrize("key", ["spec_name", "spec_module_path"])
def test_the_example_names_the_plugin(key: str) -> None:
    env = env_of(yaml.safe_load(EXAMPLE.read_text()))
    extra = json.loads(env["KV_TRANSFER_CONFIG"])["kv_connector_extra_config"]
    assert (
        extra[key]
        == {"spec_name": "KvshmOffloadingSpec", "spec_module_path": "kvshm.vllm.spec"}[key]
    )


def test_the_examples_kv_cache_may_be_either_layout_on_the_same_region(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The example leaves the layout to vLLM: its own resolution for FlashAttention (H100's
    backend, which declares no layout) gives OffloadingConnector's layer-outer LBHNC, and takes
    VLLM_KV_CACHE_LAYOUT=BLHNC (the documented choice) over it; the block-outer cache gives the
    spec the same region geometry."""
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    env = env_of(yaml.safe_load(EXAMPLE.read_text()))
    assert "VLLM_KV_CACHE_LAYOUT" not in env
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    supported = [x.name for x in get_supported_kv_cache_layouts([FlashAttentionBackend])]
    layouts = {}
    for value in (None, "BLHNC"):
        if value is not None:
            monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", value)
        config = vllm_config(tmp_path, env["KV_TRANSFER_CONFIG"], "--tensor-parallel-size=4")
        layouts[value] = resolve_kv_cache_layout(config, [supported] * 4)
    assert not layouts[None].is_block_outermost  # what the connector asks for
    assert layouts["BLHNC"].is_block_outermost
    block_outer = kv_cache_config(1024, layers=80, kv_heads=2, head_size=128, block_outer=True)
    geometry = offloading_spec(config, 1024, block_outer).region_geometry
    assert (geometry.num_chunks, geometry.cpu_page_size, geometry.num_workers) == (
        REGION["numBlocks"],
        REGION["cpuPageSize"],
        REGION["numWorkers"],
    )
