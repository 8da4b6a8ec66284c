"""What a block-outer KV cache costs decode attention: every layer's attention over a step's
sequences, their blocks drawn at random, read from one KV cache laid out layer-outer (vLLM
0.33's default, LBHNC) and block-outer (VLLM_KV_CACHE_LAYOUT=BLHNC), in the same run; GB/s of
KV read and the ratio block-outer / layer-outer.

The cache's per-layer views are vLLM's own (`create_kv_cache_views` with the strides
`compute_layout_strides` gives each layout), and the reader is vLLM's own FlashAttention 3
(`vllm.vllm_flash_attn`, fa_version=3), called as its FlashAttention backend calls it on
Hopper: K and V split out of each layer's (blocks, heads, tokens, 2 x head) view, a block
table, one query token a sequence. Each layout's output is checked against a plain reference
first. Where FlashAttention 3 does not import (vLLM without its compiled kernels, a GPU other
than 9.x), `--reader proxy` reads the same pages with a Triton kernel that sums them: the HBM
reads alone, not attention. Needs vLLM 0.33 (its KV-cache views) and a CUDA device.

    source .gpu/env.sh && python3 bench/vllm_plugin/attention_layout.py
        [--reader proxy]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from tests.vllm_plugin.layouts import REAL_LAYOUTS, KvLayout

GIB = 1 << 30
BLOCK_TOKENS = 16
HEAD = 128  # head size of the three models
LAYOUTS = ("layer-outer", "block-outer")
VLLM_LAYOUT = {"layer-outer": "LBHNC", "block-outer": "BLHNC"}
QUERY_HEADS = {  # per worker: the models' query heads over their tensor-parallel size
    "llama-3.1-8b-tp1": 32,
    "qwen2.5-7b-tp1": 28,
    "llama-3.1-70b-tp4-rank0": 64 // 4,
}
PROXY_CHUNK = 1024  # bf16 elements a proxy program reads: 2 KiB, a page being 16-64 KiB
READERS = ("flash-attention", "proxy")
Step = Callable[[str], None]


def kv_heads(model: KvLayout) -> int:
    """KV heads a worker holds: a layer's page is K and V of 16 tokens x heads x 128 bf16."""
    return model.page_bytes // (BLOCK_TOKENS * 2 * HEAD * 2)


def layer_views(raw: torch.Tensor, model: KvLayout, blocks: int, layout: str) -> list[torch.Tensor]:
    """Each layer's (blocks, kv heads, tokens, 2 x head) bf16 view of the int8 buffer `raw`,
    made by vLLM's own code for the layout, as the engine's attention layers get them."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(
        block_size=BLOCK_TOKENS, num_kv_heads=kv_heads(model), head_size=HEAD, dtype=torch.bfloat16
    )
    vllm_layout = KVCacheLayout[VLLM_LAYOUT[layout]]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, blocks, model.layers, vllm_layout)
    names = [f"model.layers.{i}.self_attn" for i in range(model.layers)]
    tensor = KVCacheTensor(
        size=raw.numel(), layers=names, layer_stride=layer_stride, block_stride=block_stride
    )
    return create_kv_cache_views(raw, spec, blocks, vllm_layout, tensor)


def key_and_value(view: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, tokens, heads, head) K and V, split as vLLM's FlashAttention backend does."""
    key, value = view.transpose(1, 2).split(HEAD, dim=-1)
    return key, value


class Decode:
    """A decode step's inputs: `seqs` sequences of `context` tokens on random blocks."""

    def __init__(self, model: KvLayout, blocks: int, seqs: int, context: int) -> None:
        per_seq = context // BLOCK_TOKENS
        generator = torch.Generator(device="cuda").manual_seed(0)
        ids = torch.randperm(blocks, device="cuda", generator=generator)[: seqs * per_seq]
        self.table = ids.to(torch.int32).view(seqs, per_seq)
        heads = QUERY_HEADS[model.name]
        self.query = torch.randn(seqs, heads, HEAD, dtype=torch.bfloat16, device="cuda")
        self.out = torch.empty_like(self.query)
        self.query_starts = torch.arange(seqs + 1, dtype=torch.int32, device="cuda")
        self.lengths = torch.full((seqs,), context, dtype=torch.int32, device="cuda")
        self.context = context


def flash_attention() -> Callable[..., Any] | str:
    """vLLM's flash_attn_varlen_func where its FlashAttention 3 runs here, else why not."""
    if torch.cuda.get_device_capability()[0] != 9:
        return f"FlashAttention 3 needs a Hopper GPU, not {torch.cuda.get_device_name()}"
    try:
        from vllm.vllm_flash_attn import flash_attn_interface as fa
    except ImportError as exc:
        return f"vLLM's FlashAttention does not import ({exc})"
    if not fa.FA3_AVAILABLE:
        return f"vLLM's FlashAttention 3 is unavailable ({fa.FA3_UNAVAILABLE_REASON})"
    return fa.flash_attn_varlen_func


def attend(attention: Callable[..., Any], view: torch.Tensor, step: Decode) -> None:
    key, value = key_and_value(view)
    attention(
        step.query,
        key,
        value,
        1,
        step.query_starts,
        step.context,
        seqused_k=step.lengths,
        block_table=step.table,
        softmax_scale=HEAD**-0.5,
        causal=True,
        out=step.out,
        fa_version=3,
    )


def reference_error(view: torch.Tensor, step: Decode, seq: int) -> float:
    """The largest difference between FlashAttention's output for one sequence and attention
    computed plainly from the blocks its table names."""
    key, value = key_and_value(view)
    ids = step.table[seq].long()
    keys = key[ids].reshape(step.context, -1, HEAD).float()
    values = value[ids].reshape(step.context, -1, HEAD).float()
    heads = keys.shape[1]
    query = step.query[seq].float().view(heads, -1, HEAD)
    weights = torch.softmax(torch.einsum("hgd,thd->hgt", query, keys) * HEAD**-0.5, dim=-1)
    expected = torch.einsum("hgt,thd->hgd", weights, values).reshape(-1, HEAD)
    return float((step.out[seq].float() - expected).abs().max())


def flash_attention_steps(
    attention: Callable[..., Any], views: dict[str, list[torch.Tensor]], step: Decode
) -> Step:
    for layout, layers in views.items():  # every layout reads right before any is timed
        attend(attention, layers[len(layers) // 2], step)
        error = reference_error(layers[len(layers) // 2], step, seq=len(step.table) // 2)
        if error > 2e-2:
            sys.exit(
                f"FlashAttention over the {layout} cache differs from the reference by {error}"
            )

    def run(layout: str) -> None:
        for view in views[layout]:
            attend(attention, view, step)

    return run


def page_reader() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def read_pages(cache, ids, out, block_stride, layer_offset, CHUNK: tl.constexpr):  # type: ignore[no-untyped-def]
        row, part = tl.program_id(0), tl.program_id(1)
        block = tl.load(ids + row).to(tl.int64)
        start = block * block_stride + layer_offset + part * CHUNK
        values = tl.load(cache + start + tl.arange(0, CHUNK)).to(tl.float32)
        tl.store(out + row * tl.num_programs(1) + part, tl.sum(values, axis=0))

    return read_pages


def proxy_steps(raw: torch.Tensor, views: dict[str, list[torch.Tensor]], step: Decode) -> Step:
    """Each layer's pages of the step's blocks read whole and summed, page by page, at the
    block stride and offset of vLLM's view."""
    read_pages, cache = page_reader(), raw.view(torch.bfloat16)
    ids = step.table.flatten()
    page = views["layer-outer"][0][0].numel()
    grid = (len(ids), page // PROXY_CHUNK)
    out = torch.empty(grid[0] * grid[1], dtype=torch.float32, device="cuda")

    def run(layout: str) -> None:
        for view in views[layout]:
            offset = view.storage_offset() - cache.storage_offset()
            read_pages[grid](cache, ids, out, view.stride(0), offset, CHUNK=PROXY_CHUNK)

    return run


def bench_model(model: KvLayout, args: argparse.Namespace, reader: Any) -> dict[str, Any]:
    blocks = int(args.cache_gib * GIB) // model.worker_bytes_per_block
    if args.context % BLOCK_TOKENS or args.seqs * args.context // BLOCK_TOKENS > blocks:
        sys.exit(
            f"{args.seqs} sequences of {args.context} tokens do not fit {model.name}'s {blocks} "
            f"blocks of {BLOCK_TOKENS} tokens: give --context a multiple of {BLOCK_TOKENS}, "
            f"fewer --seqs or a larger --cache-gib"
        )
    raw = torch.empty(blocks * model.worker_bytes_per_block, dtype=torch.int8, device="cuda")
    raw.view(torch.bfloat16).normal_(0, 0.1)
    views = {layout: layer_views(raw, model, blocks, layout) for layout in LAYOUTS}
    step = Decode(model, blocks, args.seqs, args.context)
    run = (
        proxy_steps(raw, views, step)
        if reader is None
        else flash_attention_steps(reader, views, step)
    )

    def seconds(layout: str) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.steps):
            run(layout)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    times: dict[str, list[float]] = {x: [] for x in LAYOUTS}
    for layout in LAYOUTS:
        seconds(layout)  # warm-up
    for _ in range(args.rounds):  # interleaved, so a clock ramp falls on both
        for layout in LAYOUTS:
            times[layout].append(seconds(layout))
    read = args.steps * model.layers * step.table.numel() * model.page_bytes
    rates = {x: read / statistics.median(times[x]) / 1e9 for x in LAYOUTS}
    return {
        "model": model.name,
        "blocks": blocks,
        "block_stride_bytes": views["block-outer"][0].stride(0) * 2,
        **{f"{x}_GBps": rates[x] for x in LAYOUTS},
        **{f"{x}_step_ms": 1e3 * statistics.median(times[x]) / args.steps for x in LAYOUTS},
        "ratio": rates["block-outer"] / rates["layer-outer"],
    }


def choose_reader(wanted: str) -> tuple[str, Any]:
    """(the reader's name, FlashAttention's function or None for the proxy)."""
    if wanted == "proxy":
        return "proxy", None
    attention = flash_attention()
    if not isinstance(attention, str):
        return "flash-attention", attention
    if wanted == "flash-attention":
        sys.exit(f"--reader flash-attention: {attention}")
    print(f"{attention}: reading with the Triton proxy")
    return "proxy", None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-gib", type=float, default=40.0, help="the KV cache, GiB")
    parser.add_argument("--seqs", type=int, default=64, help="sequences a decode step")
    parser.add_argument("--context", type=int, default=4096, help="tokens a sequence")
    parser.add_argument("--steps", type=int, default=3, help="steps per timed run")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--reader",
        choices=("auto", *READERS),
        default="auto",
        help="vLLM's FlashAttention 3, the Triton proxy, or (auto) the first that runs here",
    )
    parser.add_argument("--models", help="comma-separated names (default: the three models)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/vllm_plugin/attention_layout.py needs a CUDA device")
    models = [x for x in REAL_LAYOUTS if x.name in QUERY_HEADS]
    if args.models:
        models = [x for x in models if x.name in args.models.split(",")]
        if not models:
            sys.exit(f"no model matches {args.models!r}: {sorted(QUERY_HEADS)}")
    name, reader = choose_reader(args.reader)
    print(
        f"device: {torch.cuda.get_device_name()}; reader {name}; cache {args.cache_gib} GiB; "
        f"{args.seqs} sequences of {args.context} tokens a step"
    )
    print(f"{'model':26} {'blocks':>7} {'stride':>9}  layer-outer    block-outer    ratio")
    rows = []
    for model in models:
        row = bench_model(model, args, reader)
        torch.cuda.empty_cache()  # the model's cache, before the next one's
        rows.append(row)
        print(
            f"{model.name:26} {row['blocks']:7d} {row['block_stride_bytes'] // 1024:6d} KiB  "
            f"{row['layer-outer_GBps']:6.0f} GB/s    {row['block-outer_GBps']:6.0f} GB/s    "
            f"{row['ratio']:5.3f}"
        )
    if args.json:
        figures = {"device": torch.cuda.get_device_name(), "reader": name, "models": rows}
        Path(args.json).write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
