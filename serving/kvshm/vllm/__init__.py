"""kvshm inside vLLM 0.33: an OffloadingSpec that attaches the kvshm agent's region and moves
KV blocks with kvshm's transfer engine (docs/vllm-plugin.md).

vLLM loads it from `--kv-transfer-config` with
`"kv_connector_extra_config": {"spec_name": "KvshmOffloadingSpec",
"spec_module_path": "kvshm.vllm.spec", "cpu_bytes_to_use": ..., ...}`.
Only kvshm.vllm.spec, kvshm.vllm.worker, kvshm.vllm.manager and kvshm.vllm.policies import vLLM at
import (kvshm.vllm.identity inside the functions that read vLLM's config and hashing); the other
modules do not.
"""
