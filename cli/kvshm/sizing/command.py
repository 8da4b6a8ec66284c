"""`kvshm layout`: a model's config.json in; OffloadRegion YAML and vLLM's flags out."""

from __future__ import annotations

import argparse
import math
import sys
from fractions import Fraction

import yaml

from kvshm.sizing.errors import SizingError
from kvshm.sizing.model import load_config, model_kv_shape
from kvshm.sizing.plan import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_BLOCKS_PER_CHUNK,
    FORMATS,
    OffloadPlan,
    Parallelism,
    plan_offload,
    with_whole_huge_pages,
)
from kvshm.sizing.render import describe, offload_regions, vllm_flags


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def _gib(text: str) -> Fraction:
    """--cpu-gib: a finite number above 0, kept exact (1e300 GiB is too many bytes for a
    float, and the planner says how many fit)."""
    try:
        gib = float(text)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number of GiB above 0")
    return Fraction(gib)


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model", help="the model's config.json, or a directory holding it (never downloaded)"
    )
    parser.add_argument(
        "--id",
        required=True,
        help="the engine id given to vLLM (engine_id); under data parallelism vLLM appends "
        "_dp<rank>, so each engine's region gets <id>_dp<rank>",
    )
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--cpu-bytes", type=int, help="CPU bytes for each engine's region")
    size.add_argument("--cpu-gib", type=_gib, help="the same in GiB (2^30 bytes)")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1)
    parser.add_argument("--data-parallel-size", "--dp", type=int, default=1)
    parser.add_argument(
        "--block-size",
        type=int,
        default=DEFAULT_BLOCK_SIZE,
        help="vLLM's --block-size (tokens per KV block; MLA backends often need 64)",
    )
    parser.add_argument(
        "--blocks-per-chunk",
        type=int,
        default=DEFAULT_BLOCKS_PER_CHUNK,
        help="blocks per offloaded chunk (one region row); vLLM's default is 1",
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype: auto, bf16, fp16, fp8"
    )
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default=FORMATS[0],
        help="region files for vLLM 0.33 (segmented at 2 GiB and up) or 0.27-0.32 (one file)",
    )
    parser.add_argument(
        "--huge-pages",
        action="store_true",
        help="round the rows down so every region file is whole 2 MiB huge pages (on a "
        "huge-page region root the whole region then gets them; the comments say the cost)",
    )
    parser.add_argument("--name", help="the OffloadRegion's name (default: the id)")
    parser.add_argument("--namespace")
    parser.add_argument(
        "--node-selector",
        type=_label,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="spec.placement.nodeSelector (repeatable)",
    )
    parser.add_argument("--uid", type=int, help="spec.access.uid: the serving container's user")
    parser.add_argument("--gid", type=int, help="spec.access.gid")
    parser.add_argument(
        "--flags-only",
        action="store_true",
        help="print only vLLM's flags, one per line (for a container's args)",
    )


HUGE_PAGE_BYTES = 2 * 1024 * 1024  # x86-64's and arm64's (4 KiB pages) transparent huge page


def huge_pages_note(asked: OffloadPlan, plan: OffloadPlan) -> str:
    """What --huge-pages cost: the rows and bytes left out of each region."""
    before, after = asked.regions[0], plan.regions[0]
    lost = before.cpu_bytes_to_use - after.cpu_bytes_to_use
    return (
        f"--huge-pages: {after.num_blocks} rows instead of {before.num_blocks}, so every file "
        f"is whole {HUGE_PAGE_BYTES >> 20} MiB pages: {lost} bytes less per engine"
    )


def run_layout(args: argparse.Namespace) -> int:
    try:
        shape = model_kv_shape(load_config(args.model), args.model)
        cpu_bytes = args.cpu_bytes if args.cpu_bytes is not None else int(args.cpu_gib * 2**30)
        plan = plan_offload(
            shape,
            args.id,
            cpu_bytes,
            Parallelism(args.tensor_parallel_size, args.data_parallel_size),
            block_size=args.block_size,
            blocks_per_chunk=args.blocks_per_chunk,
            kv_cache_dtype=args.kv_cache_dtype,
        )
        asked = plan
        if args.huge_pages:
            plan = with_whole_huge_pages(plan, args.format, HUGE_PAGE_BYTES)
        documents = offload_regions(
            plan,
            args.name or args.id,
            namespace=args.namespace,
            region_format=args.format,
            node_selector=dict(args.node_selector),
            uid=args.uid,
            gid=args.gid,
        )
    except (SizingError, ValueError) as exc:
        print(f"kvshm layout: {exc}", file=sys.stderr)
        return 2
    if args.flags_only:
        print("\n".join(vllm_flags(plan)))
        return 0
    lines = describe(plan)
    if args.huge_pages:
        lines.insert(2, huge_pages_note(asked, plan))
    print("\n".join(f"# {line}" for line in lines))
    print(yaml.safe_dump_all(documents, sort_keys=False), end="")
    return 0
