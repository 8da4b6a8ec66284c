"""kvshm inside vLLM 0.33: an OffloadingSpec that attaches the kvshm agent's region and moves
KV blocks with kvshm's transfer engine (docs/vllm-plugin.md).

vLLM loads it from `--kv-transfer-config` with
`"kv_connector_extra_config": {"spec_name": "KvshmOffloadingSpec",
"spec_module_path": "kvshm.vllm.spec", "cpu_bytes_to_use": ..., ...}`.
The warm start (the scheduler's manager keeping the region's warm-restart index) is its own
subpackage, kvshm.vllm.warm. Only kvshm.vllm.spec, kvshm.vllm.worker and kvshm.vllm.warm's
manager, journal and policies import vLLM at import (kvshm.vllm.warm.identity inside the
functions that read vLLM's config and hashing); the other modules do not.
"""
