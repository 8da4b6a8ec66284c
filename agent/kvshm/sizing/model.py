"""What one block of a model's KV cache weighs on one tensor-parallel worker, read from the
model's Hugging Face `config.json` the way vLLM 0.33 sizes it (its attention specs'
`page_size_bytes`, summed over layers), or refused with the reason when kvshm cannot tell."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshm.sizing.errors import UnsupportedModelError

# vLLM's --kv-cache-dtype values whose cache is a plain array of one element size, and the
# element size; spellings people also use map onto vLLM's names.
KV_CACHE_DTYPE_BYTES = {
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
KV_CACHE_DTYPE_ALIASES = {"fp16": "float16", "half": "float16", "bf16": "bfloat16"}

# vLLM's DeepSeek-style MLA models whose cache is one latent of kv_lora_rank + qk_rope_head_dim
# per token and layer, nothing else (deepseek_v32 adds an indexer cache, deepseek_v4 compresses).
MLA_MODEL_TYPES = frozenset({"deepseek_v2", "deepseek_v3", "kimi_k2"})
# Model types whose layers are not all attention (state-space, linear attention, hybrids).
NON_ATTENTION_MODEL_TYPES = (
    "mamba",
    "jamba",
    "zamba",
    "falcon_h1",
    "nemotron_h",
    "granitemoehybrid",
    "bamba",
    "lfm2",
    "qwen3_next",
    "minimax",
    "plamo2",
    "rwkv",
    "recurrent_gemma",
)
NON_ATTENTION_KEYS = ("layers_block_type", "hybrid_override_pattern", "ssm_cfg", "mamba_d_state")
OTHER_MLA_TYPES = ("deepseek_v32", "deepseek_v4", "deepseek_v41", "glm_moe_dsa", "longcat_flash")


def normalise_kv_cache_dtype(kv_cache_dtype: str) -> str:
    """vLLM's name for a --kv-cache-dtype value ("auto" stays "auto"), or a clear refusal."""
    name = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    if name != "auto" and name not in KV_CACHE_DTYPE_BYTES:
        raise UnsupportedModelError(
            f"KV-cache dtype {kv_cache_dtype!r} is not one kvshm can size: use auto, "
            f"{', '.join(KV_CACHE_DTYPE_BYTES)} (per-token-head, nvfp4, turboquant and other "
            f"packed formats store scales or packed states whose size vLLM decides per backend)"
        )
    return name


@dataclass(frozen=True)
class ModelKVShape:
    """The parts of a model that decide its KV cache's size."""

    model_type: str
    num_layers: int
    num_kv_heads: int  # whole model; 1 for MLA (one latent shared by all heads)
    head_size: int  # K and V each have this many elements per head; MLA: the latent's width
    mla: bool
    dtype: str | None  # the checkpoint's dtype (what --kv-cache-dtype=auto stores), if declared

    def kv_heads_per_rank(self, tensor_parallel_size: int) -> int:
        """KV heads one tensor-parallel worker holds: vLLM splits them, and replicates them
        when there are fewer heads than workers (MLA: always the one latent)."""
        if self.mla:
            return 1
        tp, heads = tensor_parallel_size, self.num_kv_heads
        if heads % tp and tp % heads:
            raise UnsupportedModelError(
                f"{heads} KV heads cannot be split over tensor-parallel size {tp}: vLLM needs "
                f"one to divide the other"
            )
        return max(1, heads // tp)

    def cache_dtype(self, kv_cache_dtype: str) -> str:
        name = normalise_kv_cache_dtype(kv_cache_dtype)
        if name != "auto":
            return name
        if self.dtype not in ("bfloat16", "float16"):
            raise UnsupportedModelError(
                f"--kv-cache-dtype auto stores the model's dtype, and config.json declares "
                f"{self.dtype or 'none'}: pass the dtype vLLM will use (bfloat16, float16, fp8)"
            )
        return self.dtype

    def worker_bytes_per_block(
        self, tensor_parallel_size: int, block_size: int, kv_cache_dtype: str
    ) -> int:
        """vLLM's worker_kv_bytes_per_block: one block of every layer on one worker."""
        element = KV_CACHE_DTYPE_BYTES[self.cache_dtype(kv_cache_dtype)]
        heads = self.kv_heads_per_rank(tensor_parallel_size)
        per_token = self.head_size if self.mla else 2 * self.head_size  # MLA: no separate V
        return self.num_layers * heads * per_token * block_size * element


def load_config(source: str) -> dict[str, Any]:
    """config.json from a file or a model directory. A hub id cannot be fetched here."""
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(
            f"{source!r} is not a config.json file or a directory holding one. kvshm reads the "
            f"model's config from disk and never downloads: fetch it first, e.g. "
            f"`huggingface-cli download {source} config.json --local-dir <dir>`, and pass <dir>"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UnsupportedModelError(f"{path}: not a readable JSON file ({exc})") from exc
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return config


def _positive_int(config: dict[str, Any], key: str, where: str) -> int:
    value = config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnsupportedModelError(f"{where}: {key} must be a positive integer, got {value!r}")
    return value


def _refuse_non_uniform(config: dict[str, Any], model_type: str, where: str) -> None:
    """Refuse what vLLM does not cache as full-attention blocks in every layer."""
    if any(part in model_type for part in NON_ATTENTION_MODEL_TYPES) or any(
        key in config for key in NON_ATTENTION_KEYS
    ):
        raise UnsupportedModelError(
            f"{where}: model type {model_type!r} has state-space or linear-attention layers "
            f"(Mamba-style state, not KV blocks): kvshm cannot size its offload region"
        )
    if config.get("is_heterogeneous") or "block_configs" in config:
        raise UnsupportedModelError(
            f"{where}: layers differ from each other (block_configs): not sized by kvshm"
        )
    if "text_config" in config or "llm_config" in config:
        raise UnsupportedModelError(
            f"{where}: a multimodal config (text_config): pass the language model's own config.json"
        )
    if config.get("attention_chunk_size"):
        raise UnsupportedModelError(
            f"{where}: chunked local attention layers mixed with full ones (a hybrid): not "
            f"sized by kvshm"
        )
    # vLLM gives sliding-window layers a block size of the attention backend's choosing, so
    # only models whose every layer vLLM runs as full attention are sized. vLLM 0.33 reads a
    # model's sliding layers from layer_types (Qwen2 derives them from use_sliding_window);
    # Mistral-7B-v0.1's bare sliding_window is run as full attention.
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list) and set(layer_types) - {"full_attention"}:
        raise UnsupportedModelError(
            f"{where}: layers of kinds {sorted(set(layer_types))} (sliding-window or linear "
            f"attention): vLLM sizes those blocks per attention backend; kvshm sizes only "
            f"full-attention models"
        )
    sliding_from = config.get("max_window_layers") or 0
    if (
        config.get("sliding_window")
        and config.get("use_sliding_window")
        and sliding_from < config.get("num_hidden_layers", 0)
    ):
        raise UnsupportedModelError(
            f"{where}: use_sliding_window slides layers {sliding_from} and up: vLLM sizes those "
            f"blocks per attention backend; kvshm sizes only full-attention models"
        )
    for key in ("sliding_window_pattern", "interleaved_sliding_window"):
        if config.get("sliding_window") and key in config:
            raise UnsupportedModelError(
                f"{where}: sliding window on some layers ({key}): a hybrid, not sized by kvshm"
            )


def model_kv_shape(config: dict[str, Any], where: str = "config.json") -> ModelKVShape:
    """The KV-cache shape of a standard decoder (GQA/MQA/MHA) or a DeepSeek-style MLA model."""
    model_type = str(config.get("model_type") or "")
    if not model_type:
        raise UnsupportedModelError(f"{where}: no model_type: is this a model's config.json?")
    _refuse_non_uniform(config, model_type, where)
    num_layers = _positive_int(config, "num_hidden_layers", where)
    dtype = config.get("torch_dtype") or config.get("dtype")
    quantization = config.get("quantization_config") or {}
    if isinstance(quantization, dict) and any("kv_cache" in key for key in quantization):
        dtype = "a quantized KV cache (quantization_config)"
    if config.get("kv_lora_rank") is not None:
        if model_type not in MLA_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{where}: MLA model type {model_type!r} is not sized by kvshm (supported MLA "
                f"types: {', '.join(sorted(MLA_MODEL_TYPES))}; "
                f"{', '.join(OTHER_MLA_TYPES)} keep extra caches or compress)"
            )
        latent = _positive_int(config, "kv_lora_rank", where)
        rope = _positive_int(config, "qk_rope_head_dim", where)
        return ModelKVShape(model_type, num_layers, 1, latent + rope, True, dtype)
    heads = _positive_int(config, "num_attention_heads", where)
    kv_heads = config.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else _positive_int(config, "num_key_value_heads", where)
    head_dim = config.get("head_dim")
    if head_dim is None or head_dim == 0:
        hidden = _positive_int(config, "hidden_size", where)
        head_dim = hidden // heads
    else:
        head_dim = _positive_int(config, "head_dim", where)
    return ModelKVShape(model_type, num_layers, kv_heads, head_dim, False, dtype)
