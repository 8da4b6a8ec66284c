"""What one block of a model's KV cache weighs on one tensor-parallel worker, read from the
model's Hugging Face `config.json` the way vLLM 0.33 sizes it (its attention specs'
`page_size_bytes`, summed over layers), or refused with the reason when kvshm cannot tell."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshm.sizing.errors import UnsupportedModelError, quoted, require_int

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


def _config_int(config: dict[str, Any], key: str, where: str, *, minimum: int = 1) -> int:
    return require_int(
        config.get(key), f"{where}: {key}", minimum=minimum, error=UnsupportedModelError
    )


def _optional_int(config: dict[str, Any], key: str, where: str) -> int | None:
    """A key that is absent, null, or a count (0 included)."""
    return None if config.get(key) is None else _config_int(config, key, where, minimum=0)


def _optional(config: dict[str, Any], key: str, kind: type, expected: str, where: str) -> Any:
    """A key that is absent, null, or of JSON type `kind` (str, bool or dict)."""
    value = config.get(key)
    if value is not None and not isinstance(value, kind):
        raise UnsupportedModelError(f"{where}: {key} must be {expected}, got {quoted(value)}")
    return value


def _layer_kinds(config: dict[str, Any], where: str) -> set[str]:
    """The kinds of layer layer_types names (none when config.json does not give it)."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        return set()
    if not isinstance(layer_types, list) or not all(isinstance(kind, str) for kind in layer_types):
        raise UnsupportedModelError(
            f"{where}: layer_types must be a list of strings, one layer kind per layer (e.g. "
            f'"full_attention"), got {quoted(layer_types)}'
        )
    return set(layer_types)


def _refuse_non_uniform(config: dict[str, Any], model_type: str, where: str) -> None:
    """Refuse what vLLM does not cache as full-attention blocks in every layer."""
    if any(part in model_type for part in NON_ATTENTION_MODEL_TYPES) or any(
        key in config for key in NON_ATTENTION_KEYS
    ):
        raise UnsupportedModelError(
            f"{where}: model type {model_type!r} has state-space or linear-attention layers "
            f"(Mamba-style state, not KV blocks): kvshm cannot size its offload region"
        )
    if _optional(config, "is_heterogeneous", bool, "true or false", where) or (
        "block_configs" in config
    ):
        raise UnsupportedModelError(
            f"{where}: layers differ from each other (block_configs): not sized by kvshm"
        )
    if "text_config" in config or "llm_config" in config:
        raise UnsupportedModelError(
            f"{where}: a multimodal config (text_config): pass the language model's own config.json"
        )
    if _optional_int(config, "attention_chunk_size", where):
        raise UnsupportedModelError(
            f"{where}: chunked local attention layers mixed with full ones (a hybrid): not "
            f"sized by kvshm"
        )
    # vLLM gives sliding-window layers a block size of the attention backend's choosing, so
    # only models whose every layer vLLM runs as full attention are sized. vLLM 0.33 reads a
    # model's sliding layers from layer_types (Qwen2 derives them from use_sliding_window);
    # Mistral-7B-v0.1's bare sliding_window is run as full attention.
    layer_kinds = _layer_kinds(config, where)
    if layer_kinds - {"full_attention"}:
        raise UnsupportedModelError(
            f"{where}: layers of kinds {sorted(layer_kinds)} (sliding-window or linear "
            f"attention): vLLM sizes those blocks per attention backend; kvshm sizes only "
            f"full-attention models"
        )
    sliding_window = _optional_int(config, "sliding_window", where)
    use_sliding_window = _optional(config, "use_sliding_window", bool, "true or false", where)
    if sliding_window and use_sliding_window:
        sliding_from = _optional_int(config, "max_window_layers", where) or 0
        if sliding_from < _config_int(config, "num_hidden_layers", where):
            raise UnsupportedModelError(
                f"{where}: use_sliding_window slides layers {sliding_from} and up: vLLM sizes "
                f"those blocks per attention backend; kvshm sizes only full-attention models"
            )
    for key in ("sliding_window_pattern", "interleaved_sliding_window"):
        if sliding_window and key in config:
            raise UnsupportedModelError(
                f"{where}: sliding window on some layers ({key}): a hybrid, not sized by kvshm"
            )


def model_kv_shape(config: dict[str, Any], where: str = "config.json") -> ModelKVShape:
    """The KV-cache shape of a standard decoder (GQA/MQA/MHA) or a DeepSeek-style MLA model."""
    model_type = _optional(config, "model_type", str, "a string", where)
    if not model_type:
        raise UnsupportedModelError(f"{where}: no model_type: is this a model's config.json?")
    _refuse_non_uniform(config, model_type, where)
    num_layers = _config_int(config, "num_hidden_layers", where)
    dtype_key = "torch_dtype" if config.get("torch_dtype") else "dtype"
    dtype = _optional(config, dtype_key, str, 'a string such as "bfloat16"', where) or None
    quantization = _optional(config, "quantization_config", dict, "an object", where) or {}
    if any("kv_cache" in key for key in quantization):
        dtype = "a quantized KV cache (quantization_config)"
    if config.get("kv_lora_rank") is not None:
        if model_type not in MLA_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{where}: MLA model type {model_type!r} is not sized by kvshm (supported MLA "
                f"types: {', '.join(sorted(MLA_MODEL_TYPES))}; "
                f"{', '.join(OTHER_MLA_TYPES)} keep extra caches or compress)"
            )
        latent = _config_int(config, "kv_lora_rank", where)
        rope = _config_int(config, "qk_rope_head_dim", where)
        return ModelKVShape(model_type, num_layers, 1, latent + rope, True, dtype)
    heads = _config_int(config, "num_attention_heads", where)
    kv_heads = heads
    if config.get("num_key_value_heads") is not None:
        kv_heads = _config_int(config, "num_key_value_heads", where)
    # head_dim absent, null or 0 means hidden_size // num_attention_heads, as vLLM derives it
    head_dim = _optional_int(config, "head_dim", where)
    if not head_dim:
        hidden = _config_int(config, "hidden_size", where)
        head_dim = hidden // heads
        if head_dim < 1:
            raise UnsupportedModelError(
                f"{where}: hidden_size {hidden} // num_attention_heads {heads} gives a head_dim "
                f"of 0: hidden_size must be at least num_attention_heads, or config.json must "
                f"give head_dim"
            )
    return ModelKVShape(model_type, num_layers, kv_heads, head_dim, False, dtype)
