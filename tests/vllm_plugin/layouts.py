"""KV-cache layouts for the plugin's tests and bench, and building vLLM's CanonicalKVCaches.

Real model layouts are the per-worker tensors vLLM 0.33 builds at block size 16, one tensor
per layer holding K and V: page = 2 x 16 tokens x kv_heads x head_size x 2 bytes (bf16). That
is its layer-outer KV cache (LBHNC, which its OffloadingConnector asks for). With a
block-outer one (VLLM_KV_CACHE_LAYOUT=BLHNC) a block's layers lie back to back, and vLLM's
connector worker hands the offloading spec one tensor whose page is the whole block.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    block_outer: bool = False
    """One tensor whose page holds every layer of a block (vLLM's packed view of a
    block-outer KV cache; one group)."""

    @property
    def worker_bytes_per_block(self) -> int:
        return self.layers * self.page_bytes

    @property
    def tensor_pages(self) -> list[int]:
        """Each GPU tensor's page in bytes."""
        if self.block_outer:
            return [self.worker_bytes_per_block]
        return [self.page_bytes] * self.layers


# K or V page = 16 tokens x kv_heads/TP x 128 x 2 bytes; a layer's block holds both
REAL_LAYOUTS = (
    KvLayout("llama-3.1-8b-tp1", 32, 2 * 32 * KIB),  # 8 KV heads: 32 KiB per K or V page
    KvLayout("qwen2.5-7b-tp1", 28, 2 * 16 * KIB),  # 4 KV heads: 16 KiB
    KvLayout("llama-3.1-70b-tp4-rank0", 80, 2 * 8 * KIB),  # 8 KV heads / 4: 8 KiB
    KvLayout("2mib-blocks", 4, 2 * KIB * KIB),
)
# the three models with a block-outer KV cache: one 2 MiB, 896 KiB or 1.25 MiB page a block
BLOCK_OUTER_LAYOUTS = tuple(
    replace(x, name=f"{x.name}-block-outer", block_outer=True) for x in REAL_LAYOUTS[:3]
)
MULTI_GROUP = KvLayout("two-groups", 8, 2 * 16 * KIB, groups=2)


def canonical_kv_caches(
    layout: KvLayout, num_blocks: int, device: str | torch.device, seed: int = 0
) -> object:
    """vLLM's CanonicalKVCaches for the layout: an int8 tensor per layer (or one for the
    whole block, block-outer), views of one allocation filled with a random pattern, layers
    dealt round-robin into the groups."""
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )

    generator = torch.Generator().manual_seed(seed)
    pages = layout.tensor_pages
    # one allocation, as vLLM 0.33's allocate_kv_cache makes: layer-outer, layer l's pages
    # from l * num_blocks * page on
    backing = torch.randint(
        -128, 128, (len(pages), num_blocks, pages[0]), dtype=torch.int8, generator=generator
    ).to(device)
    tensors = [CanonicalKVCacheTensor(backing[i], page) for i, page in enumerate(pages)]
    groups: list[list[object]] = [[] for _ in range(layout.groups)]
    for index, page in enumerate(layout.tensor_pages):
        groups[index % layout.groups].append(CanonicalKVCacheRef(index, page))
    return CanonicalKVCaches(tensors=tensors, group_data_refs=groups)
