"""What a block-outer KV cache costs the reads of attention: each layer's pages of a step's
blocks read from one cache laid out layer-outer (vLLM 0.33's default, LBHNC: layer l's page of
block b at (l x blocks + b) x page) and block-outer (VLLM_KV_CACHE_LAYOUT=BLHNC: at
(b x layers + l) x page), GB/s of HBM and their ratio, in the same run.

A proxy, not the attention kernel: a Triton kernel reads each page whole (as a decode step's
attention reads its blocks' K and V, page by page) and sums it, so the figures compare only how
the HBM and its address translation serve the two layouts, not FlashAttention's own compute.
Needs a CUDA device and Triton.

    PYTHONPATH=agent:operator python3 bench/vllm_plugin/attention_layout.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
from tests.vllm_plugin.layouts import REAL_LAYOUTS, KvLayout

GIB = 1 << 30
CHUNK = 1024  # bf16 elements a program reads: 2 KiB, a page being 8-64 KiB
LAYOUTS = ("layer-outer", "block-outer")


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


def strides(layout: str, layers: int, blocks: int, page: int, layer: int) -> tuple[int, int]:
    """(block stride, layer l's offset) in elements."""
    if layout == "layer-outer":
        return page, layer * blocks * page
    return layers * page, layer * page


def bench_model(model: KvLayout, args: argparse.Namespace, read_pages: Any) -> dict[str, float]:
    page = model.page_bytes // 2  # bf16 elements
    blocks = int(args.cache_gib * GIB) // model.worker_bytes_per_block
    per_step = min(blocks, int(args.gib_per_layer * GIB) // model.page_bytes)
    cache = torch.randn(blocks * model.layers * page, dtype=torch.bfloat16, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    steps = [
        torch.randperm(blocks, device="cuda", generator=generator)[:per_step].to(torch.int32)
        for _ in range(args.steps)
    ]
    grid = (per_step, page // CHUNK)
    out = torch.empty(grid[0] * grid[1], dtype=torch.float32, device="cuda")

    def run(layout: str) -> float:
        """Seconds for the steps: every layer's pages of each step's blocks."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for ids in steps:
            for layer in range(model.layers):
                stride, offset = strides(layout, model.layers, blocks, page, layer)
                read_pages[grid](cache, ids, out, stride, offset, CHUNK=CHUNK)
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1e3

    times: dict[str, list[float]] = {x: [] for x in LAYOUTS}
    for layout in LAYOUTS:
        run(layout)  # warm-up: compiles for this layout's argument types
    for _ in range(args.rounds):  # interleaved, so a clock ramp falls on both
        for layout in LAYOUTS:
            times[layout].append(run(layout))
    moved = args.steps * model.layers * per_step * model.page_bytes
    rates = {x: moved / statistics.median(times[x]) / 1e9 for x in LAYOUTS}
    return {
        "blocks": blocks,
        "blocks_per_step": per_step,
        **{f"{x}_GBps": rates[x] for x in LAYOUTS},
        "ratio": rates["block-outer"] / rates["layer-outer"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-gib", type=float, default=40.0, help="the KV cache, GiB")
    parser.add_argument(
        "--gib-per-layer", type=float, default=0.25, help="pages a step reads per layer, GiB"
    )
    parser.add_argument("--steps", type=int, default=4, help="steps per timed run")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/vllm_plugin/attention_layout.py needs a CUDA device")
    read_pages = page_reader()
    print(f"device: {torch.cuda.get_device_name()}; cache {args.cache_gib} GiB")
    print(f"{'model':26} {'blocks':>7} {'a step':>7}  layer-outer  block-outer  ratio")
    for model in REAL_LAYOUTS[:3]:
        row = bench_model(model, args, read_pages)
        torch.cuda.empty_cache()  # the model's cache, before the next one's
        print(
            f"{model.name:26} {row['blocks']:7d} {row['blocks_per_step']:7d}  "
            f"{row['layer-outer_GBps']:8.0f} GB/s {row['block-outer_GBps']:8.0f} GB/s  "
            f"{row['ratio']:5.3f}"
        )


if __name__ == "__main__":
    main()
