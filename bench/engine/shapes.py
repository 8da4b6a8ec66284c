"""Model shapes the engine benchmark runs with dummy weights: each a Hugging Face config.json
(architecture and sizes as published), written to a directory the engine loads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Shape:
    name: str
    config: dict[str, Any]

    @property
    def layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def kv_heads(self) -> int:
        return int(self.config["num_key_value_heads"])

    @property
    def head_dim(self) -> int:
        c = self.config
        return int(c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"])

    @property
    def vocab(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer, bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * 2

    @property
    def kv_bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * BLOCK_SIZE

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config, indent=1))
        return directory


LLAMA_31_8B = Shape(
    "llama-3.1-8b",
    {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    },
)

QWEN_25_7B = Shape(
    "qwen2.5-7b",
    {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "num_hidden_layers": 28,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
)

# the largest published dense shape whose bf16 dummy weights (65.5 GB) leave an H100 room for
# a few GiB of KV cache
QWEN_25_32B = Shape(
    "qwen2.5-32b",
    {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 5120,
        "intermediate_size": 27648,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "num_hidden_layers": 64,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "max_window_layers": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
)

# a small Llama-shaped model for the GPU tests: an engine of it starts in seconds
LLAMA_TINY = Shape(
    "llama-tiny",
    {
        **LLAMA_31_8B.config,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "num_hidden_layers": 4,
        "vocab_size": 32000,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
)

SHAPES = {s.name: s for s in (LLAMA_31_8B, QWEN_25_7B, QWEN_25_32B, LLAMA_TINY)}
