"""kvshm.sizing and `kvshm layout`: per-worker bytes per block for the shipped public configs,
the regions and flags it prints, and clear refusals for what it cannot size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from kvshm.api import GROUP, REGION_PLURAL, VERSION, parse_offload_region
from kvshm.cli import main
from kvshm.region import RegionLayout
from kvshm.sizing import (
    Parallelism,
    SizingError,
    UnsupportedModelError,
    load_config,
    model_kv_shape,
    plan_offload,
)

MODELS = Path(__file__).resolve().parent / "models"


def _shape(model: str) -> Any:
    return model_kv_shape(load_config(str(MODELS / model)))


@pytest.mark.parametrize(
    ("model", "tp", "dtype", "expected"),
    [
        ("llama-3.1-70b", 4, "auto", 80 * 2 * 2 * 128 * 16 * 2),  # 1,310,720
        ("llama-3.1-70b", 16, "auto", 80 * 2 * 1 * 128 * 16 * 2),  # heads replicated
        ("llama-3.1-8b", 1, "fp8", 32 * 2 * 8 * 128 * 16 * 1),
        ("qwen2.5-7b", 2, "bf16", 28 * 2 * 2 * 128 * 16 * 2),
        ("mistral-7b-v0.1", 8, "fp16", 32 * 2 * 1 * 128 * 16 * 2),
        ("deepseek-v2-lite", 4, "auto", 27 * (512 + 64) * 16 * 2),  # MLA: one latent, any TP
    ],
)
def test_worker_bytes_per_block(model: str, tp: int, dtype: str, expected: int) -> None:
    assert _shape(model).worker_bytes_per_block(tp, 16, dtype) == expected


def test_rows_are_padded_to_a_page_and_budget_is_exact() -> None:
    plan = plan_offload(_shape("qwen2.5-7b"), "q", 10**9, Parallelism(1), blocks_per_chunk=3)
    [region] = plan.regions
    assert region.cpu_page_size == 3 * 28 * 2 * 4 * 128 * 16 * 2
    assert region.row_stride % 4096 == 0 and region.row_stride >= region.cpu_page_size
    assert region.num_blocks == 10**9 // region.row_stride
    assert region.cpu_bytes_to_use == region.num_blocks * region.row_stride


def test_mla_is_replicated_only_with_several_workers() -> None:
    shape = _shape("deepseek-v2-lite")
    assert not plan_offload(shape, "d", 1 << 30, Parallelism(1)).regions[0].replicated
    [region] = plan_offload(shape, "d", 1 << 30, Parallelism(4)).regions
    assert region.replicated and region.row_stride == -(-region.cpu_page_size // 4096) * 4096


def _layout(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["layout", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_prints_one_region_per_data_parallel_engine_and_the_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    common = [str(MODELS / "llama-3.1-8b"), "--id", "llama8", "--cpu-gib", "2", "--tp", "2"]
    code, out, err = _layout(capsys, *common, "--dp", "2", "--namespace", "serving")
    assert code == 0, err
    documents = list(yaml.safe_load_all(out))
    assert [d["metadata"]["name"] for d in documents] == ["llama8-dp0", "llama8-dp1"]
    assert [d["spec"]["instanceId"] for d in documents] == ["llama8_dp0", "llama8_dp1"]
    layout = documents[0]["spec"]["layout"]
    assert layout == {
        "format": "vllm-0.33",
        "numBlocks": (2 << 30) // (2 * 32 * 2 * 4 * 128 * 16 * 2),
        "cpuPageSize": 32 * 2 * 4 * 128 * 16 * 2,
        "numWorkers": 2,
        "replicated": False,
    }
    code, out, err = _layout(capsys, *common, "--dp", "2", "--flags-only")
    flags = out.splitlines()
    assert flags[:4] == [
        "--tensor-parallel-size=2",
        "--data-parallel-size=2",
        "--block-size=16",
        "--kv-cache-dtype=auto",
    ]
    assert flags[4] == "--kv-transfer-config"
    transfer = json.loads(flags[5])
    assert transfer == {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": "llama8",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": layout["numBlocks"] * 2 * layout["cpuPageSize"],
            "blocks_per_chunk": 1,
        },
    }


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"model_type": "jamba", "num_hidden_layers": 4}, "state-space"),
        ({"model_type": "gemma3_text", "num_hidden_layers": 2, "sliding_window": 512,
          "layer_types": ["sliding_attention", "full_attention"]}, "sliding-window or linear"),
        ({"model_type": "qwen2", "num_hidden_layers": 28, "sliding_window": 4096,
          "use_sliding_window": True, "max_window_layers": 21}, "layers 21 and up"),
        ({"model_type": "mistral", "num_hidden_layers": 2, "sliding_window": 512,
          "layer_types": ["sliding_attention"] * 2}, "full-attention models"),
        ({"model_type": "llama4", "text_config": {}}, "multimodal"),
        ({"model_type": "deepseek_v32", "num_hidden_layers": 2, "kv_lora_rank": 512}, "MLA"),
        ({"model_type": "llama"}, "num_hidden_layers"),
    ],
)  # fmt: skip
def test_models_it_cannot_size_are_refused_with_the_reason(
    config: dict[str, Any], says: str
) -> None:
    with pytest.raises(UnsupportedModelError, match=says):
        model_kv_shape(config)


def test_bad_parallelism_dtype_and_budget_are_refused() -> None:
    shape = _shape("llama-3.1-8b")  # 8 KV heads
    with pytest.raises(UnsupportedModelError, match="cannot be split over tensor-parallel size 3"):
        shape.worker_bytes_per_block(3, 16, "auto")
    with pytest.raises(UnsupportedModelError, match="nvfp4"):
        shape.worker_bytes_per_block(1, 16, "nvfp4")
    with pytest.raises(SizingError, match="hold no chunk"):
        plan_offload(shape, "x", 4096, Parallelism(1))
    llama = load_config(str(MODELS / "llama-3.1-8b"))
    float32 = model_kv_shape({**llama, "torch_dtype": "float32"})
    with pytest.raises(UnsupportedModelError, match="pass the dtype"):
        float32.worker_bytes_per_block(1, 16, "auto")


def test_cli_refuses_a_hub_id_saying_how_to_fetch_the_config(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _layout(capsys, "meta-llama/Llama-3.1-8B", "--id", "x", "--cpu-gib", "1")
    assert code == 2 and not out
    assert "never downloads" in err and "huggingface-cli download meta-llama/Llama-3.1-8B" in err


LLAMA_8B = json.loads((MODELS / "llama-3.1-8b" / "config.json").read_text())
QWEN_SLIDING = {
    **json.loads((MODELS / "qwen2.5-7b" / "config.json").read_text()),
    "use_sliding_window": True,
}


def _layout_of(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, config: dict[str, Any], *args: str
) -> tuple[int, str, str]:
    """`kvshm layout` of a config.json written to tmp_path."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    return _layout(capsys, str(tmp_path), "--id", "m", *args)


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({**QWEN_SLIDING, "num_hidden_layers": "32"},
         "num_hidden_layers must be a positive integer, got '32'"),
        ({**QWEN_SLIDING, "max_window_layers": "x"},
         "max_window_layers must be an integer of at least 0, got 'x'"),
        ({**LLAMA_8B, "layer_types": [["full_attention"]]},
         "layer_types must be a list of strings, one layer kind per layer"),
        ({**LLAMA_8B, "layer_types": ["sliding_attention", 1]},
         "layer_types must be a list of strings, one layer kind per layer"),
        ({**LLAMA_8B, "layer_types": "full_attention"}, "layer_types must be a list of strings"),
        ({**LLAMA_8B, "num_attention_heads": 32, "hidden_size": 16},
         "hidden_size 16 // num_attention_heads 32 gives a head_dim of 0"),
        ({**LLAMA_8B, "head_dim": "128"}, "head_dim must be an integer of at least 0, got '128'"),
        ({**LLAMA_8B, "head_dim": True}, "head_dim must be an integer of at least 0, got True"),
        ({**QWEN_SLIDING, "use_sliding_window": "false"},
         "use_sliding_window must be true or false, got 'false'"),
        ({**QWEN_SLIDING, "sliding_window": [4096]}, "sliding_window must be an integer"),
        ({**LLAMA_8B, "attention_chunk_size": "8192"}, "attention_chunk_size must be an integer"),
        ({**LLAMA_8B, "is_heterogeneous": "no"}, "is_heterogeneous must be true or false"),
        ({**LLAMA_8B, "model_type": ["llama"]}, "model_type must be a string, got ['llama']"),
        ({**LLAMA_8B, "torch_dtype": 16}, "torch_dtype must be a string"),
        ({**LLAMA_8B, "quantization_config": ["kv_cache"]},
         "quantization_config must be an object"),
    ],
)  # fmt: skip
def test_cli_refuses_a_malformed_config_naming_the_key_and_value(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, config: dict[str, Any], says: str
) -> None:
    code, out, err = _layout_of(capsys, tmp_path, config, "--cpu-gib", "8")
    assert code == 2 and not out
    assert err.startswith("kvshm layout: ") and says in err
    assert len(err.splitlines()) == 1  # one line, no traceback


@pytest.mark.parametrize("gib", ["inf", "-inf", "nan", "0", "-1", "lots"])
def test_cli_refuses_cpu_gib_that_is_not_finite_and_positive(
    capsys: pytest.CaptureFixture[str], gib: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        _layout(capsys, str(MODELS / "llama-3.1-8b"), "--id", "m", f"--cpu-gib={gib}")
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert f"argument --cpu-gib: {gib!r} is not a finite number of GiB above 0" in err


LARGEST_LLAMA_8B_REGION = (2**63 - 1) // (32 * 2 * 8 * 128 * 16 * 2) * (32 * 2 * 8 * 128 * 16 * 2)


@pytest.mark.parametrize("budget", [["--cpu-bytes", str(10**30)], ["--cpu-gib", "1e300"]])
def test_cli_refuses_more_bytes_than_a_region_can_hold_saying_the_largest(
    capsys: pytest.CaptureFixture[str], budget: list[str]
) -> None:
    code, out, err = _layout(capsys, str(MODELS / "llama-3.1-8b"), "--id", "m", *budget)
    assert code == 2 and not out and len(err.splitlines()) == 1
    assert f"the largest that fits is {LARGEST_LLAMA_8B_REGION} bytes" in err


def test_cli_prints_the_largest_region_that_fits_and_the_agent_reads_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = str(MODELS / "llama-3.1-8b")
    code, out, err = _layout(
        capsys, model, "--id", "m", "--cpu-bytes", str(LARGEST_LLAMA_8B_REGION)
    )
    assert code == 0, err
    [document] = yaml.safe_load_all(out)
    assert parse_offload_region(document).size_bytes == LARGEST_LLAMA_8B_REGION
    code, out, err = _layout(
        capsys, model, "--id", "m", "--cpu-bytes", str(LARGEST_LLAMA_8B_REGION + 2**21)
    )
    assert code == 2 and "the largest that fits" in err


def test_the_api_server_accepts_the_largest_region_it_prints(
    capsys: pytest.CaptureFixture[str], envtest_admin: Any, envtest_namespace: str
) -> None:
    model = str(MODELS / "llama-3.1-8b")
    budget = ["--cpu-bytes", str(LARGEST_LLAMA_8B_REGION)]
    code, out, err = _layout(capsys, model, "--id", "m", *budget, "--namespace", envtest_namespace)
    assert code == 0, err
    [document] = yaml.safe_load_all(out)
    created = kubernetes.client.CustomObjectsApi(envtest_admin).create_namespaced_custom_object(
        GROUP, VERSION, envtest_namespace, REGION_PLURAL, document
    )
    assert created["spec"]["layout"]["numBlocks"] == document["spec"]["layout"]["numBlocks"]


def test_cli_refuses_a_chunk_larger_than_any_region(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = {**LLAMA_8B, "num_hidden_layers": 10**15}
    code, out, err = _layout_of(capsys, tmp_path, config, "--cpu-bytes", str(10**30))
    assert code == 2 and not out and len(err.splitlines()) == 1
    assert "more than a region can hold (9223372036854775807 bytes)" in err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tp", "2048"], "spec.layout.numWorkers is 2048; at most 1024 are allowed"),
        (["--uid", "-1"], "spec.access uid/gid must be in [0, 2147483647]"),
        (["--node-selector", "a/b/c=d"], "nodeSelector keys must be label keys"),
    ],
)
def test_cli_never_prints_an_offload_region_the_agent_refuses(
    capsys: pytest.CaptureFixture[str], args: list[str], says: str
) -> None:
    model = str(MODELS / "llama-3.1-8b")
    code, out, err = _layout(capsys, model, "--id", "m", "--cpu-gib", "1", *args)
    assert code == 2 and not out
    assert "the OffloadRegion would be refused" in err and says in err


def test_huge_pages_rounds_the_rows_so_every_file_is_whole_huge_pages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Llama-3.1-70B at TP 4, 64 GiB: 5 MiB rows; 13107 rows leave the last file ending 1 MiB
    into a huge page, 13106 do not."""
    common = [str(MODELS / "llama-3.1-70b"), "--id", "l70", "--cpu-gib", "64", "--tp", "4"]
    code, out, err = _layout(capsys, *common)
    assert code == 0, err
    plain = next(yaml.safe_load_all(out))["spec"]["layout"]
    code, out, err = _layout(capsys, *common, "--huge-pages")
    assert code == 0, err
    aligned = next(yaml.safe_load_all(out))["spec"]["layout"]
    assert (plain["numBlocks"], aligned["numBlocks"]) == (13107, 13106)
    layout = RegionLayout(aligned["numBlocks"], aligned["cpuPageSize"], 4)
    assert layout.huge_page_tail_bytes(2 << 20) == 0 and layout.file_count == 32
    assert "--huge-pages: 13106 rows instead of 13107" in out
    assert f"{5 << 20} bytes less per engine" in out
    code, out, err = _layout(capsys, *common, "--huge-pages", "--flags-only")
    flags = out.splitlines()
    transfer = json.loads(flags[flags.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_extra_config"]["cpu_bytes_to_use"] == layout.size_bytes
