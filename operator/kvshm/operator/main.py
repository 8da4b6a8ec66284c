"""Wiring and entry point: kopf's decorators applied to the handlers, and `kvshm-operator`.

`register()` is where kopf meets kvshm (as crate-operator's main module does): which resource,
which cause, which interval, under which metric name. `kopf run -m kvshm.operator` gets the
handlers registered with the environment's settings (kvshm/operator/__init__.py); the console
script registers them with its flags into a registry of its own.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import kopf

from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION
from kvshm.operator import handlers
from kvshm.operator.config import ENV_PREFIX, ConfigError, OperatorConfig
from kvshm.operator.metrics import instrumented

REGION = (GROUP, VERSION, REGION_PLURAL)
OFFLOAD_NODE = (GROUP, VERSION, NODE_PLURAL)
NODE = ("v1", "nodes")

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


def _not_deleting(meta: kopf.Meta, **_: Any) -> bool:
    return not meta.get("deletionTimestamp")


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> kopf.OperatorRegistry:
    """Every handler of the operator, registered into registry."""
    on = kopf.on
    on.startup(registry=registry)(handlers.startup)
    on.login(registry=registry)(handlers.login)
    on.probe(id="regions", registry=registry)(handlers.probe_regions)

    # The cluster as the decisions see it: kopf keeps these indexes from watch streams.
    kopf.index(*NODE, registry=registry)(handlers.node_labels)
    kopf.index(*OFFLOAD_NODE, registry=registry)(handlers.agents)
    kopf.index(*REGION, registry=registry)(handlers.region_paths)
    kopf.index(*REGION, registry=registry, id="live_region_paths", when=_not_deleting)(
        handlers.region_paths
    )

    # OffloadRegion: validate, keep status level-based, hold the finalizer through deletion.
    validate = instrumented("validate")(handlers.validate)
    for cause in (on.create, on.resume):
        cause(*REGION, registry=registry, id="validate")(validate)
    on.update(*REGION, field="spec", registry=registry, id="validate")(validate)
    on.event(*REGION, registry=registry, id="region_changed")(
        instrumented("region_event")(handlers.region_changed)
    )
    kopf.timer(*REGION, interval=config.region_resync_seconds, registry=registry, id="resync")(
        instrumented("region_resync")(handlers.region_resync)
    )
    on.delete(*REGION, registry=registry, id="release")(instrumented("delete")(handlers.release))

    # OffloadNode: gone nodes and orphan reclaim.
    kopf.timer(*OFFLOAD_NODE, interval=config.node_sweep_seconds, registry=registry, id="sweep")(
        instrumented("node_sweep")(handlers.sweep_node)
    )
    on.event(*OFFLOAD_NODE, registry=registry, id="offload_node_changed")(
        handlers.offload_node_changed
    )
    return registry


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvshm-operator",
        description="Reconcile OffloadRegions and OffloadNodes (kopf). Every option can also "
        f"be set as an environment variable {ENV_PREFIX}<OPTION> (e.g. "
        f"{ENV_PREFIX}ORPHAN_GRACE_SECONDS).",
    )
    for item in fields(OperatorConfig):
        flag = "--" + item.name.replace("_", "-")
        if item.name == "orphan_dry_run":
            parser.add_argument(flag, action="store_true", default=None, help="report only")
        else:
            parser.add_argument(flag, default=None, metavar="VALUE")
    parser.add_argument(
        "--liveness",
        default=DEFAULT_LIVENESS,
        help=f"liveness endpoint URL (default {DEFAULT_LIVENESS}; 'none' to disable)",
    )
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        action="append",
        default=[],
        help="serve only the OffloadRegions of these namespaces (repeatable)",
    )
    scope.add_argument(
        "--all-namespaces", action="store_true", help="serve every namespace (the default)"
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    return parser.parse_args(argv)


def apply_to_environment(args: argparse.Namespace) -> OperatorConfig:
    """Put the flags given into the environment, then read and validate the whole config."""
    for item in fields(OperatorConfig):
        value = getattr(args, item.name)
        if value is not None:
            os.environ[ENV_PREFIX + item.name.upper()] = str(value)
    return OperatorConfig.from_env()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = apply_to_environment(args)
    except ConfigError as exc:
        print(f"kvshm-operator: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    liveness = None if args.liveness.lower() == "none" else args.liveness
    kopf.run(
        registry=register(kopf.OperatorRegistry(), config),
        memo=kopf.Memo(config=config),
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
