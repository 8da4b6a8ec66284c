"""An OffloadPlan as people use it: OffloadRegion manifests and the vLLM flags that attach them."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from typing import Any

from kvshm.api.address import is_dns_subdomain
from kvshm.api.offload_region import SpecError, parse_offload_region
from kvshm.region.naming import validate_instance_id
from kvshm.sizing.errors import SizingError
from kvshm.sizing.plan import OffloadPlan

API_VERSION = "kvshm.dev/v1alpha1"


def kv_transfer_config(plan: OffloadPlan) -> dict[str, Any]:
    """vLLM 0.33's --kv-transfer-config: the OffloadingConnector, the region's engine id (vLLM
    appends _dp<rank> itself) and the bytes and chunking that give the region's geometry."""
    [first, *_] = plan.regions
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": plan.engine_id,
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": first.cpu_bytes_to_use,
            "blocks_per_chunk": first.blocks_per_chunk,
        },
    }


def vllm_flags(plan: OffloadPlan) -> list[str]:
    """The `vllm serve` arguments that make vLLM compute exactly the plan's regions."""
    parallel = plan.parallelism
    flags = [f"--tensor-parallel-size={parallel.tensor_parallel_size}"]
    if parallel.data_parallel_size > 1:
        flags.append(f"--data-parallel-size={parallel.data_parallel_size}")
    flags += [
        f"--block-size={plan.block_size}",
        f"--kv-cache-dtype={plan.kv_cache_dtype}",
        "--kv-transfer-config",
        json.dumps(kv_transfer_config(plan), separators=(",", ":")),
    ]
    return flags


def region_name(name: str, rank: int | None) -> str:
    full = name if rank is None else f"{name}-dp{rank}"
    if not is_dns_subdomain(full):
        raise SizingError(
            f"region name {full!r} is not a Kubernetes object name: use lower-case letters, "
            f"digits, '-' and '.', starting and ending with a letter or digit"
        )
    return full


def offload_regions(
    plan: OffloadPlan,
    name: str,
    *,
    namespace: str | None = None,
    region_format: str = "vllm-0.33",
    node_selector: Mapping[str, str] | None = None,
    uid: int | None = None,
    gid: int | None = None,
) -> list[dict[str, Any]]:
    """One OffloadRegion per data-parallel engine, named <name> or <name>-dp<rank>, each one the
    agent and the CRD accept (else SizingError)."""
    documents = []
    many = len(plan.regions) > 1
    for rank, region in enumerate(plan.regions):
        metadata: dict[str, Any] = {"name": region_name(name, rank if many else None)}
        if namespace:
            metadata["namespace"] = namespace
        spec: dict[str, Any] = {
            "instanceId": validate_instance_id(region.engine_id),
            "layout": {
                "format": region_format,
                "numBlocks": region.num_blocks,
                "cpuPageSize": region.cpu_page_size,
                "numWorkers": region.num_workers,
                "replicated": region.replicated,
            },
        }
        if node_selector:
            spec["placement"] = {"nodeSelector": dict(node_selector)}
        if uid is not None or gid is not None:
            spec["access"] = {"uid": uid or 0, "gid": gid or 0, "mode": 0o600}
        document = {
            "apiVersion": API_VERSION,
            "kind": "OffloadRegion",
            "metadata": metadata,
            "spec": spec,
        }
        try:  # the agent's and the operator's own reading, with the CRD's bounds
            parse_offload_region(document)
        except SpecError as exc:
            raise SizingError(f"the OffloadRegion would be refused: {exc}") from None
        documents.append(document)
    return documents


def describe(plan: OffloadPlan) -> list[str]:
    """Comment lines: how the numbers came about, and the flags as one shell line."""
    [first, *_] = plan.regions
    copies = 1 if first.replicated else first.num_workers
    return [
        f"per-worker KV bytes per block: {plan.worker_bytes_per_block} "
        f"(block size {plan.block_size}, kv-cache dtype {plan.kv_cache_dtype})",
        f"row = round_up({first.cpu_page_size} x {copies} cell(s), 4096) = {first.row_stride} "
        f"bytes; {first.num_blocks} rows = {first.cpu_bytes_to_use} bytes per engine",
        "vLLM flags (vllm serve <model> ...):",
        "  " + shlex.join(vllm_flags(plan)),
    ]
