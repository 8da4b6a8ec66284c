"""vLLM's own path from `--kv-transfer-config` to an OffloadingSpec, on a CPU machine:
EngineArgs parses the flags, create_engine_config builds the VllmConfig, the connector's
build_offloading_config translates it, and OffloadingSpecFactory loads the spec."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

# a Llama-shaped model small enough to write: 4 layers, 2 KV heads of 64, bf16, so one
# layer's block at block size 16 is 2 x 16 x 2 x 64 x 2 = 8 KiB
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 512,
    "intermediate_size": 1024,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
}
TINY_LAYERS = 4
TINY_PAGE = 2 * 16 * 2 * 64 * 2
# the engine the tests configure: 2 blocks per chunk, 48 chunks of 64 KiB, 40 GPU blocks
BLOCKS_PER_CHUNK = 2
CPU_PAGE = TINY_LAYERS * TINY_PAGE * BLOCKS_PER_CHUNK  # one worker's cell: 64 KiB
NUM_CHUNKS = 48
GPU_BLOCKS = 40


def write_model(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY_LLAMA))
    return directory


def kv_transfer_config(engine_id: str, extra: dict[str, Any]) -> str:
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "engine_id": engine_id,
            "kv_connector_extra_config": {
                "spec_name": "KvshmOffloadingSpec",
                "spec_module_path": "kvshm.vllm.spec",
                **extra,
            },
        }
    )


def vllm_config(model_dir: Path, kv_transfer_json: str, *flags: str) -> Any:
    """VllmConfig from command-line flags, parsed by vLLM's own EngineArgs."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model",
            str(model_dir),
            "--skip-tokenizer-init",
            "--block-size",
            "16",
            "--kv-transfer-config",
            kv_transfer_json,
            *flags,
        ]
    )
    return EngineArgs.from_cli_args(args).create_engine_config()


def kv_cache_config(
    num_blocks: int,
    layers: int = TINY_LAYERS,
    kv_heads: int = 2,
    head_size: int = 64,
    block_outer: bool = False,
) -> Any:
    """The KVCacheConfig the engine would give a Llama-shaped model on one worker (kv_heads
    per worker, bf16, block size 16): one full-attention group, one tensor per layer, in one
    backing allocation, layer-outermost or (block_outer) block-outermost."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )

    spec = FullAttentionSpec(
        block_size=16, num_kv_heads=kv_heads, head_size=head_size, dtype=torch.bfloat16
    )
    page = spec.page_size_bytes
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    total = page * layers * num_blocks
    layer_stride, block_stride = (page, page * layers) if block_outer else (page * num_blocks, page)
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=total,
                layers=[name],
                layer_stride=layer_stride,
                block_stride=block_stride,
                offset=i * layer_stride,
            )
            for i, name in enumerate(names)
        ],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )


def offloading_spec(config: Any, num_gpu_blocks: int, kv_cache: Any = None) -> Any:
    """The spec vLLM's factory creates for the engine's config."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    kv_cache = kv_cache if kv_cache is not None else kv_cache_config(num_gpu_blocks)
    offloading = build_offloading_config(config, kv_cache)
    return OffloadingSpecFactory.create_spec(offloading)
