"""Run by tests/against_vllm in a subprocess with vLLM 0.33 (or 0.32) importable: for each case (a
model directory and `vllm serve` arguments), vLLM's own code parses the arguments, builds the
ModelConfig from the model's config.json, the attention layers' KV-cache specs, the
OffloadingConfig and the CPUOffloadingSpec, and this prints the region geometry that spec uses,
per data-parallel engine.

Input: JSON list of {"model": dir, "args": [...]} as argv[1]. Output: JSON on stdout.
"""

from __future__ import annotations

import copy
import json
import sys
from types import SimpleNamespace
from typing import Any

from vllm.config import CacheConfig, ParallelConfig
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
    build_offloading_config,
)
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype
from vllm.v1.engine.utils import _apply_dp_identity_suffix
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    get_kv_quant_mode,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

try:  # where vLLM 0.33 keeps them
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.v1.core.kv_cache_planning import kv_cache_groups_tp_replicas
except ImportError:  # vLLM 0.32
    from vllm.entrypoints.launchers.cli_args import make_arg_parser  # type: ignore[no-redef]
    from vllm.v1.core.kv_cache_utils import kv_cache_groups_tp_replicas  # type: ignore[no-redef]

# This machine has no CUDA: vLLM would keep the per-rank tensor path here. On CUDA it uses the
# shared region (and MLA's replicated layout), which is what kvshm serves: say so.
CPUOffloadingSpec._uses_shared_region = lambda self: True  # type: ignore[method-assign]


def parse_serve_args(model: str, args: list[str]) -> AsyncEngineArgs:
    """`vllm serve <model> <args>` as vLLM's CLI parses it (the parser `vllm serve` builds)."""
    parsed = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args([model, *args])
    parsed.model = parsed.model_tag  # what ServeSubcommand.cmd does
    return AsyncEngineArgs.from_cli_args(parsed)


def layer_spec(engine_args: AsyncEngineArgs, model_config: Any, parallel: Any) -> Any:
    """What vLLM's Attention / MLAAttention.get_kv_cache_spec returns for one decoder layer."""
    cache_dtype = engine_args.kv_cache_dtype
    common = dict(
        block_size=engine_args.block_size,
        head_size=model_config.get_head_size(),
        dtype=kv_cache_dtype_str_to_dtype(cache_dtype, model_config),
        kv_quant_mode=get_kv_quant_mode(cache_dtype),
    )
    if model_config.use_mla:
        return MLAAttentionSpec(
            **common, num_kv_heads=1, max_tp_shards=1, cache_dtype_str=cache_dtype
        )
    return FullAttentionSpec(**common, num_kv_heads=model_config.get_num_kv_heads(parallel))


def geometry(model: str, args: list[str]) -> list[dict[str, Any]]:
    engine_args = parse_serve_args(model, args)
    model_config = engine_args.create_model_config()
    parallel = ParallelConfig(
        tensor_parallel_size=engine_args.tensor_parallel_size,
        distributed_executor_backend="mp",
    )
    cache = CacheConfig(block_size=engine_args.block_size, cache_dtype=engine_args.kv_cache_dtype)
    layers = model_config.get_num_layers_by_block_type(parallel, "attention")
    spec = layer_spec(engine_args, model_config, parallel)
    groups = [KVCacheGroupSpec([f"model.layers.{i}.self_attn.attn" for i in range(layers)], spec)]
    kv_cache_config = KVCacheConfig(num_blocks=1024, kv_cache_tensors=[], kv_cache_groups=groups)
    kv_cache_config.kv_tp_replicas = kv_cache_groups_tp_replicas(
        groups, parallel.tensor_parallel_size
    )
    results = []
    for dp_rank in range(engine_args.data_parallel_size):
        engine = SimpleNamespace(
            instance_id="", kv_transfer_config=copy.deepcopy(engine_args.kv_transfer_config)
        )
        if engine_args.data_parallel_size > 1:
            _apply_dp_identity_suffix(engine, dp_rank)
        vllm_config = SimpleNamespace(
            kv_transfer_config=engine.kv_transfer_config,
            parallel_config=parallel,
            cache_config=cache,
            model_config=model_config,
            kv_events_config=None,
            use_v2_model_runner=False,
        )
        config = build_offloading_config(vllm_config, kv_cache_config)
        offload = CPUOffloadingSpec(config)
        results.append(
            {
                "engine_id": config.engine_id,
                "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
                "num_chunks": offload.num_chunks,
                "kv_bytes_per_chunk": offload.kv_bytes_per_chunk,
                "cpu_page_size_per_worker": offload.cpu_page_size_per_worker,
                "replicated_layout": offload.replicated_layout,
                "world_size": config.parallel.world_size,
                "block_size": cache.block_size,
            }
        )
    return results


def main() -> None:
    cases = json.loads(sys.argv[1])
    print(json.dumps([geometry(case["model"], case["args"]) for case in cases]))


if __name__ == "__main__":
    main()
