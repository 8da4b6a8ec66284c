"""bench/vllm_plugin/attention_layout.py's cache: vLLM's own per-layer views put layer l's page
of block b where the docs say the two layouts put it, over one buffer (CPU, in CI)."""

from __future__ import annotations

import pytest
import torch
from bench.vllm_plugin.attention_layout import HEAD, key_and_value, kv_heads, layer_views

from tests.vllm_plugin.layouts import REAL_LAYOUTS, KvLayout

QWEN = next(x for x in REAL_LAYOUTS if x.name == "qwen2.5-7b-tp1")
BLOCKS = 6


def page_at(model: KvLayout, layout: str, layer: int, block: int) -> int:
    """Where the docs put a page, in bytes: layer-outer (LBHNC) (l x blocks + b) x page,
    block-outer (BLHNC) (b x layers + l) x page."""
    if layout == "layer-outer":
        return (layer * BLOCKS + block) * model.page_bytes
    return (block * model.layers + layer) * model.page_bytes


@pytest.mark.parametrize("layout", ["layer-outer", "block-outer"])
def test_each_layers_view_holds_its_pages_where_the_layout_puts_them(layout: str) -> None:
    raw = torch.zeros(BLOCKS * QWEN.worker_bytes_per_block, dtype=torch.int8)
    views = layer_views(raw, QWEN, BLOCKS, layout)
    assert len(views) == QWEN.layers
    base = raw.data_ptr()
    for layer in (0, 5, QWEN.layers - 1):
        view = views[layer]
        assert view.shape == (BLOCKS, kv_heads(QWEN), 16, 2 * HEAD)
        assert view.dtype == torch.bfloat16
        for block in (0, 1, BLOCKS - 1):
            page = view[block]
            assert page.is_contiguous()
            assert page.data_ptr() - base == page_at(QWEN, layout, layer, block)
            assert page.numel() * 2 == QWEN.page_bytes


def test_key_and_value_interleave_per_token_as_vllms_flash_attention_reads_them() -> None:
    raw = torch.zeros(BLOCKS * QWEN.worker_bytes_per_block, dtype=torch.int8)
    view = layer_views(raw, QWEN, BLOCKS, "layer-outer")[2]
    view[3, 1, 7, :HEAD] = 1.0  # block 3, head 1, token 7: its K
    view[3, 1, 7, HEAD:] = 2.0  # and its V
    key, value = key_and_value(view)
    assert key.shape == value.shape == (BLOCKS, 16, kv_heads(QWEN), HEAD)
    assert bool((key[3, 7, 1] == 1.0).all()) and bool((value[3, 7, 1] == 2.0).all())
    assert float(key.float().sum()) == HEAD and float(value.float().sum()) == 2 * HEAD
