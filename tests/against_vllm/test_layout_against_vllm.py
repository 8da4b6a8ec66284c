"""`kvshm layout` checked by vLLM 0.33's own code: its flags, parsed by `vllm serve`'s parser,
with the model's config.json read by vLLM's ModelConfig, give an OffloadingConfig and a
CPUOffloadingSpec whose geometry and engine id are exactly the OffloadRegions'. The same for the
`vllm serve` arguments of the Deployments in examples/serving. And vLLM 0.32.0 (single-file
regions, the vllm-0.27 format) computes the same geometry from the same flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvshm.sizing import (
    Parallelism,
    load_config,
    model_kv_shape,
    offload_regions,
    plan_offload,
    vllm_flags,
)
from tests.against_vllm.vllm_code import offload_geometry
from tests.charts.rendering import load_yaml_documents
from tests.charts.test_serving_example import EXAMPLES, IDS

MODELS = Path(__file__).resolve().parents[1] / "sizing" / "models"
# the examples' hub ids, and the shipped config.json vLLM reads instead (no hub here)
EXAMPLE_MODELS = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",  # examples/serving/quickstart
    "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "deepseek-ai/DeepSeek-V2-Lite": "deepseek-v2-lite",
}

# (model, tp, dp, block size, blocks per chunk, kv-cache dtype, CPU bytes per engine)
CASES = [
    ("llama-3.1-8b", 1, 1, 16, 1, "auto", 8 << 30),
    ("llama-3.1-8b", 2, 2, 16, 4, "fp8", 3 << 30),
    ("llama-3.1-70b", 4, 1, 16, 1, "auto", 64 << 30),
    ("llama-3.1-70b", 8, 1, 32, 2, "bf16", 100 << 30),
    ("llama-3.1-70b", 16, 1, 16, 1, "auto", 10 << 30),  # 8 KV heads replicated over 16 ranks
    ("qwen2.5-7b", 1, 1, 16, 1, "auto", 5 << 30),
    ("qwen2.5-7b", 2, 1, 16, 3, "fp16", (7 << 30) + 12345),
    ("mistral-7b-v0.1", 1, 1, 16, 1, "auto", 4 << 30),
    ("mistral-7b-v0.1", 4, 2, 16, 1, "fp8_e4m3", 2 << 30),
    ("deepseek-v2-lite", 1, 1, 64, 1, "auto", 8 << 30),
    ("deepseek-v2-lite", 2, 2, 64, 1, "auto", 8 << 30),  # MLA: replicated at TP > 1
    ("deepseek-v2-lite", 4, 1, 16, 2, "fp8", 3 << 30),
]


def _ours(
    case: tuple[Any, ...], region_format: str = "vllm-0.33"
) -> tuple[list[str], list[dict[str, Any]]]:
    model, tp, dp, block, per_chunk, dtype, cpu_bytes = case
    plan = plan_offload(
        model_kv_shape(load_config(str(MODELS / model))),
        "engine-a",
        cpu_bytes,
        Parallelism(tp, dp),
        block_size=block,
        blocks_per_chunk=per_chunk,
        kv_cache_dtype=dtype,
    )
    return vllm_flags(plan), offload_regions(plan, "engine-a", region_format=region_format)


def _example_serve_args(deployment: Path) -> dict[str, Any]:
    """The Deployment's `vllm serve` arguments, the model read from its shipped config.json."""
    [document] = load_yaml_documents(deployment)
    [engine] = document["spec"]["template"]["spec"]["containers"]
    assert engine["command"] == ["vllm", "serve"]
    model, *args = engine["args"]
    return {"model": str(MODELS / EXAMPLE_MODELS[model]), "args": args}


@pytest.fixture(scope="module")
def vllm_geometry() -> list[list[dict[str, Any]]]:
    """One vLLM run for every case and every example (vLLM takes long to import)."""
    cases = [{"model": str(MODELS / case[0]), "args": _ours(case)[0]} for case in CASES]
    examples = [_example_serve_args(deployment) for _, deployment in EXAMPLES]
    return offload_geometry(cases + examples)


@pytest.fixture(scope="module")
def vllm_032_geometry() -> list[list[dict[str, Any]]]:
    cases = [{"model": str(MODELS / case[0]), "args": _ours(case)[0]} for case in CASES]
    return offload_geometry(cases, release="0.32.0")


def _assert_same_geometry(engines: list[dict[str, Any]], regions: list[dict[str, Any]]) -> None:
    assert len(engines) == len(regions)
    for engine, region in zip(engines, regions, strict=True):
        layout = region["spec"]["layout"]
        copies = 1 if layout["replicated"] else layout["numWorkers"]
        row_stride = -(-layout["cpuPageSize"] * copies // 4096) * 4096
        assert engine["engine_id"] == region["spec"]["instanceId"]
        assert engine["num_chunks"] == layout["numBlocks"]
        assert engine["kv_bytes_per_chunk"] == row_stride
        assert engine["cpu_page_size_per_worker"] == layout["cpuPageSize"]
        assert engine["replicated_layout"] == layout["replicated"]
        assert engine["world_size"] == layout["numWorkers"]


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "-".join(map(str, CASES[i][:6])))
def test_vllm_computes_the_regions_layout(index: int, vllm_geometry: list[Any]) -> None:
    _, regions = _ours(CASES[index])
    assert len(regions) == CASES[index][2]
    _assert_same_geometry(vllm_geometry[index], regions)


@pytest.mark.parametrize("index", range(len(EXAMPLES)), ids=IDS)
def test_vllm_parses_the_examples_into_their_regions(index: int, vllm_geometry: list[Any]) -> None:
    regions = load_yaml_documents(EXAMPLES[index][0])
    _assert_same_geometry(vllm_geometry[len(CASES) + index], regions)


def test_llama_70b_at_tp4_has_vllms_cell(vllm_geometry: list[Any]) -> None:
    """The issue's example: 80 layers x 2 x 2 KV heads x 128 x 16 tokens x 2 bytes."""
    [engine] = vllm_geometry[CASES.index(("llama-3.1-70b", 4, 1, 16, 1, "auto", 64 << 30))]
    assert engine["worker_kv_bytes_per_block"] == 80 * 2 * 2 * 128 * 16 * 2 == 1_310_720


@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "-".join(map(str, CASES[i][:6])))
def test_vllm_032_computes_the_single_file_regions_layout(
    index: int, vllm_032_geometry: list[Any]
) -> None:
    _, regions = _ours(CASES[index], region_format="vllm-0.27")
    assert {r["spec"]["layout"]["format"] for r in regions} == {"vllm-0.27"}
    _assert_same_geometry(vllm_032_geometry[index], regions)
