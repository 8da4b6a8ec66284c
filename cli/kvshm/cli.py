"""`kvshm`: the command-line entry point for people (the agent and operator have their own)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvshm.demo import add_demo_arguments, run_demo, run_demo_worker
from kvshm.region import RegionError
from kvshm.sizing.command import add_layout_arguments, run_layout


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvshm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="create, populate and lock a region, attach one process per worker, report timings",
    )
    add_demo_arguments(demo)
    layout = commands.add_parser(
        "layout",
        help="a model's config.json -> the OffloadRegion(s) and the vLLM flags that attach them",
    )
    add_layout_arguments(layout)
    worker = commands.add_parser("demo-worker", help=argparse.SUPPRESS)
    worker.add_argument("spec")
    args = parser.parse_args(argv)
    try:
        if args.command == "layout":
            return run_layout(args)
        if args.command == "demo-worker":
            return run_demo_worker(args.spec)
        return run_demo(args)
    except (RegionError, OSError) as exc:
        print(f"kvshm: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
