"""`kvshm-operator`: flags and KVSHM_OPERATOR_* variables to one validated config, the handlers
registered with it into a registry of this run's own (kvshm.operator.wiring), then kopf.run.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields

import kopf
from kopf._core.engines.peering import Identity  # kopf.run's type; not re-exported by kopf

from kvshm.operator.config import ENV_PREFIX, ConfigError, OperatorConfig
from kvshm.operator.logs import configure_logging
from kvshm.operator.memo import OperatorMemo
from kvshm.operator.wiring import register

DEFAULT_LIVENESS = "http://0.0.0.0:8080/healthz"


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


def config_from(args: argparse.Namespace, environ: Mapping[str, str]) -> OperatorConfig:
    """The whole config, validated: the variables of environ, overridden by the flags given.
    The process's environment is left as it is."""
    flags = {
        ENV_PREFIX + item.name.upper(): str(getattr(args, item.name))
        for item in fields(OperatorConfig)
        if getattr(args, item.name) is not None
    }
    return OperatorConfig.from_env({**environ, **flags})


def peering_identity(environ: Mapping[str, str]) -> str:
    """This process's name among kopf's peers: the pod's (POD_ID, as kopf reads it) or host
    and pid. Never the user name: kopf's default asks getpwuid(), which fails for a uid with no
    passwd entry, as the image's 65532 and any arbitrary uid a platform assigns."""
    return environ.get("POD_ID") or f"kvshm-operator@{socket.gethostname()}/{os.getpid()}"


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = config_from(args, os.environ)
    except ConfigError as exc:
        print(f"kvshm-operator: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    liveness = None if args.liveness.lower() == "none" else args.liveness
    kopf.run(
        registry=register(kopf.OperatorRegistry(), config),
        memo=OperatorMemo(config=config),
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        liveness_endpoint=liveness,
        identity=Identity(peering_identity(os.environ)),
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
