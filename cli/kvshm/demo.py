"""`kvshm demo`: a real local run of the region library, what the agent and a serving pod each
do, timed.

The "agent" step creates, populates and locks the region in this process; then one process per
worker attaches as a serving worker would (attach-only, never creating), checks the pattern the
agent wrote into its cells, writes its own, and reports how long attaching took.

It reads OffloadRegion YAML (kvshm.api), so it lives beside the CLI, not in kvshm.region: the
region library a serving pod imports depends on nothing of the CRDs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import yaml

from kvshm.api import OffloadRegion, SpecError, parse_offload_region
from kvshm.region.layout import RegionFormat, RegionLayout
from kvshm.region.shared_region import OpenMode, SharedOffloadRegion

GB = 1e9


def add_demo_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("region", nargs="?", help="an OffloadRegion YAML file")
    parser.add_argument("--blocks", type=int, help="numBlocks (overrides the file)")
    parser.add_argument("--cpu-page-size", type=int, help="cpuPageSize in bytes")
    parser.add_argument("--workers", type=int, help="numWorkers")
    parser.add_argument("--instance-id", help="instanceId")
    parser.add_argument("--directory", default="/dev/shm/kvshm-demo", help="region directory")
    parser.add_argument("--threads", type=int, help="populate threads (default: up to 8)")
    parser.add_argument("--keep", action="store_true", help="leave the region file in place")


def load_region(args: argparse.Namespace) -> OffloadRegion:
    manifest: dict[str, Any] = {"kind": "OffloadRegion", "metadata": {"name": "demo"}, "spec": {}}
    if args.region:
        with open(args.region) as f:
            manifest = yaml.safe_load(f)
    spec = manifest.setdefault("spec", {})
    layout = spec.setdefault("layout", {})
    for flag, key in (
        ("blocks", "numBlocks"),
        ("cpu_page_size", "cpuPageSize"),
        ("workers", "numWorkers"),
    ):
        if getattr(args, flag) is not None:
            layout[key] = getattr(args, flag)
    layout.setdefault("numBlocks", 4096)
    layout.setdefault("cpuPageSize", 65536)
    if args.instance_id:
        spec["instanceId"] = args.instance_id
    try:
        return parse_offload_region(manifest)
    except SpecError as exc:
        raise SystemExit(f"kvshm demo: {args.region or 'flags'}: {exc}") from exc


def pattern(block: int, rank: int) -> int:
    return (block * 7 + rank * 31 + 1) % 256


def cell_owner(layout: RegionLayout, rank: int) -> int:
    """The rank whose pattern a cell holds: in a replicated layout every rank shares rank 0's."""
    return 0 if layout.replicated else rank


def run_demo(args: argparse.Namespace) -> int:
    region = load_region(args)
    layout = region.layout
    os.makedirs(args.directory, mode=0o700, exist_ok=True)
    print(
        f"region {region.key}: {layout.describe()} = {layout.size_bytes / 2**30:.2f} GiB "
        f"in {args.directory}"
    )
    started = time.monotonic()
    owner = SharedOffloadRegion(
        region.instance_id,
        layout,
        directory=args.directory,
        mode=OpenMode.CREATE,
        file_mode=region.access.mode,
        populate=region.populate,
        populate_threads=args.threads,
    )
    try:
        created = time.monotonic() - started
        print(f"  created {owner.mmap_path} (mode {region.access.mode:04o})")
        if region.populate:
            seconds = owner.populate_seconds
            print(
                f"  populated {layout.size_bytes / 2**30:.2f} GiB in {seconds:.3f} s "
                f"({layout.size_bytes / seconds / GB:.2f} GB/s, "
                f"{owner.populate_method.value if owner.populate_method else '-'}); "
                f"resident {owner.resident_bytes() / 2**30:.2f} GiB"
            )
        if region.lock:
            lock_started = time.monotonic()
            owner.lock()
            print(f"  locked in memory (mlock) in {time.monotonic() - lock_started:.3f} s")
        rows = owner.create_kv_memoryview().cast("B")
        for block in range(layout.num_blocks):
            for rank in range(layout.num_workers):
                rows[layout.cell_offset(block, rank)] = pattern(block, cell_owner(layout, rank))
        print(
            f"  agent side ready after {time.monotonic() - started:.3f} s (create {created:.3f} s)"
        )
        results = [
            _spawn_worker(region, args.directory, rank) for rank in range(layout.num_workers)
        ]
        failed = False
        for rank, result in enumerate(results):
            ok = result["ok"] and rows[layout.cell_offset(0, rank) + 1] == 0xA5
            failed |= not ok
            print(
                f"  worker {rank}: attached in {result['attach_seconds'] * 1e3:.2f} ms, "
                f"checked {layout.num_blocks} cells, wrote its own: {'ok' if ok else 'FAILED'}"
            )
        rows.release()
        print("done: " + ("every worker saw the agent's bytes" if not failed else "MISMATCH"))
        return 1 if failed else 0
    finally:
        if args.keep:
            owner.keep_file()
            print(f"  kept {owner.mmap_path}")
        owner.cleanup()


def _spawn_worker(region: OffloadRegion, directory: str, rank: int) -> dict[str, Any]:
    spec = json.dumps(
        {
            "instance_id": region.instance_id,
            "blocks": region.layout.num_blocks,
            "page": region.layout.cpu_page_size,
            "workers": region.layout.num_workers,
            "format": region.layout.format.value,
            "replicated": region.layout.replicated,
            "rank": rank,
            "directory": directory,
        }
    )
    out = subprocess.run(
        [sys.executable, "-m", "kvshm.cli", "demo-worker", spec],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def run_demo_worker(spec_json: str) -> int:
    """One serving worker: attach only, check the agent's pattern in its cells, mark them."""
    spec = json.loads(spec_json)
    blocks, rank = spec["blocks"], spec["rank"]
    layout = RegionLayout(
        blocks, spec["page"], spec["workers"], RegionFormat(spec["format"]), spec["replicated"]
    )
    started = time.monotonic()
    with SharedOffloadRegion(
        spec["instance_id"],
        layout,
        rank,
        directory=spec["directory"],
        mode=OpenMode.ATTACH,
        attach_timeout=5,
    ) as region:
        attach_seconds = time.monotonic() - started
        rows = region.create_kv_memoryview().cast("B")
        ok = all(
            rows[layout.cell_offset(b, rank)] == pattern(b, cell_owner(layout, rank))
            for b in range(blocks)
        )
        rows[layout.cell_offset(0, rank) + 1] = 0xA5
        rows.release()
    print(json.dumps({"ok": ok, "attach_seconds": attach_seconds}))
    return 0
