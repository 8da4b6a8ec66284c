"""KV-cache layouts for the plugin's tests and bench, and building vLLM's CanonicalKVCaches.

Real model layouts are the per-worker tensors vLLM 0.33 builds at block size 16, one tensor
per layer holding K and V: page = 2 x 16 tokens x kv_heads x head_size x 2 bytes (bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KIB = 1024


@dataclass(frozen=True)
class KvLayout:
    name: str
    layers: int
    page_bytes: int
    """One layer's block (K and V) on one worker."""
    groups: int = 1
    """KV-cache groups; layers are dealt round-robin into them."""

    @property
    def worker_bytes_per_block(self) -> int:
        return self.layers * self.page_bytes


# K or V page = 16 tokens x kv_heads/TP x 128 x 2 bytes; a layer's block holds both
REAL_LAYOUTS = (
    KvLayout("llama-3.1-8b-tp1", 32, 2 * 32 * KIB),  # 8 KV heads: 32 KiB per K or V page
    KvLayout("qwen2.5-7b-tp1", 28, 2 * 16 * KIB),  # 4 KV heads: 16 KiB
    KvLayout("llama-3.1-70b-tp4-rank0", 80, 2 * 8 * KIB),  # 8 KV heads / 4: 8 KiB
    KvLayout("2mib-blocks", 4, 2 * KIB * KIB),
)
MULTI_GROUP = KvLayout("two-groups", 8, 2 * 16 * KIB, groups=2)


def canonical_kv_caches(
    layout: KvLayout, num_blocks: int, device: str | torch.device, seed: int = 0
) -> object:
    """vLLM's CanonicalKVCaches for the layout: one int8 tensor per layer, filled with a
    distinct random pattern, layers dealt round-robin into the groups."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    generator = torch.Generator().manual_seed(seed)
    tensors = []
    for _ in range(layout.layers):
        data = torch.randint(
            -128, 128, (num_blocks, layout.page_bytes), dtype=torch.int8, generator=generator
        )
        tensors.append(CanonicalKVCacheTensor(data.to(device), layout.page_bytes))
    groups: list[list[object]] = [[] for _ in range(layout.groups)]
    for index in range(layout.layers):
        groups[index % layout.groups].append(CanonicalKVCacheRef(index, layout.page_bytes))
    return CanonicalKVCaches(tensors=tensors, group_data_refs=groups)
