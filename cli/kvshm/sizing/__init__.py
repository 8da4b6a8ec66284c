"""kvshm.sizing: a model's config.json, vLLM's parallelism and a CPU budget in; the OffloadRegion
layout vLLM 0.33 computes for it and the vLLM flags that attach it out."""

from kvshm.sizing.errors import SizingError, UnsupportedModelError
from kvshm.sizing.model import ModelKVShape, load_config, model_kv_shape
from kvshm.sizing.plan import OffloadPlan, Parallelism, RegionPlan, plan_offload
from kvshm.sizing.render import kv_transfer_config, offload_regions, vllm_flags

__all__ = [
    "ModelKVShape",
    "OffloadPlan",
    "Parallelism",
    "RegionPlan",
    "SizingError",
    "UnsupportedModelError",
    "kv_transfer_config",
    "load_config",
    "model_kv_shape",
    "offload_regions",
    "plan_offload",
    "vllm_flags",
]
