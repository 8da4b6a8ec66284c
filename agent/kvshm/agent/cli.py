"""`kvshm-agent`: the node agent, in a cluster (a DaemonSet) or locally from YAML files.

    kvshm-agent --local examples/regions            # this machine, regions from YAML files
    kvshm-agent --local examples/regions --once     # reconcile, print the table, exit
    kvshm-agent --node-name "$NODE_NAME"            # in a cluster (in-cluster config or kubeconfig)
    kvshm-agent mount-root --root DIR --size 256g   # put the root on a huge-page tmpfs (--help)

Stopping the agent (SIGTERM, Ctrl-C) releases nothing: region files stay where they are and
the next start adopts them.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from types import FrameType

from kvshm.agent.app import AgentStartError, build_app
from kvshm.agent.config import (
    DEFAULT_PORT,
    DEFAULT_ROOT,
    LOG_LEVELS,
    AgentConfig,
    AgentConfigError,
)
from kvshm.agent.printable import PrintableFormatter
from kvshm.agent.root.descriptors import raise_soft_limit
from kvshm.agent.root.mountroot import run as mount_root
from kvshm.agent.root.rootpages import HugePagesMode
from kvshm.agent.sizes import parse_bytes
from kvshm.agent.tenantfiles import DEFAULT_ALLOWANCE_BYTES

log = logging.getLogger("kvshm.agent")


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not a label: use KEY=VALUE")
    return key, value


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvshm-agent",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = parser.add_argument_group("mode")
    mode.add_argument(
        "--local",
        metavar="DIR",
        help="reconcile the OffloadRegion YAML files in DIR on this machine (no cluster)",
    )
    mode.add_argument(
        "--once", action="store_true", help="reconcile until settled, print the table, exit"
    )
    mode.add_argument("--kubeconfig", help="cluster mode: kubeconfig (default: in-cluster)")
    node = parser.add_argument_group("node")
    node.add_argument(
        "--node-name", help="this node's name (default: $NODE_NAME, else the host name)"
    )
    node.add_argument(
        "--node-label",
        type=_label,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="local mode: a label of this node, for spec.placement.nodeSelector (repeatable)",
    )
    node.add_argument("--root", default=DEFAULT_ROOT, help=f"region root (default {DEFAULT_ROOT})")
    node.add_argument(
        "--reserve-bytes",
        type=_bytes,
        default=0,
        help="bytes of the root's filesystem never given to regions (e.g. 2Gi)",
    )
    node.add_argument(
        "--tenant-files-bytes",
        type=_bytes,
        default=DEFAULT_ALLOWANCE_BYTES,
        help="bytes a serving pod may keep in its region directory (its /dev/shm) besides the "
        "region and its warm-restart index before the region's status says it is over "
        "(default 1Gi)",
    )
    node.add_argument(
        "--huge-pages",
        choices=[mode.value for mode in HugePagesMode],
        default=HugePagesMode.WARN.value,
        help="when the root gives region files no 2 MiB huge pages (a tmpfs mounted without "
        "huge=): start and warn (warn, the default), refuse to start (require), or say "
        "nothing (ignore)",
    )
    regions = parser.add_argument_group("regions")
    regions.add_argument("--drain-grace-seconds", type=float, default=30.0)
    regions.add_argument(
        "--populate-threads", type=int, default=None, help="default: one per CPU, at most 8"
    )
    regions.add_argument(
        "--populate-rate",
        type=_bytes,
        default=None,
        metavar="BYTES_PER_SECOND",
        help="cap populate throughput (e.g. 2Gi) so a busy node keeps its memory bandwidth",
    )
    regions.add_argument(
        "--parallel-regions",
        type=int,
        default=1,
        help="regions populated at once (default 1: each gets every populate thread)",
    )
    regions.add_argument(
        "--proc-scan",
        action="store_true",
        help="also treat files mapped or open by any visible process as held (needs hostPID)",
    )
    regions.add_argument(
        "--lock-table",
        default="/proc/locks",
        metavar="PATH",
        help="the lock table holders are counted from (default /proc/locks); in a pod without "
        "hostPID, the host's /proc/locks mounted read-only: a procfs lists only the locks of "
        "processes in its own PID namespace",
    )
    loop = parser.add_argument_group("loop and serving")
    loop.add_argument("--resync-seconds", type=float, default=30.0)
    loop.add_argument("--poll-seconds", type=float, default=1.0, help="local mode: poll DIR")
    loop.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help="/metrics, /healthz, /readyz (0: any)"
    )
    loop.add_argument(
        "--bind", default=None, help="address to serve on (default 0.0.0.0; local 127.0.0.1)"
    )
    loop.add_argument("--no-http", action="store_true", help="serve nothing")
    loop.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    return parser


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> AgentConfig:
    """The validated config of a parsed command line; the node name from the environment
    ($NODE_NAME, else the host name) when no flag gives it."""
    return AgentConfig(
        node_name=args.node_name or environ.get("NODE_NAME") or socket.gethostname(),
        local=args.local,
        kubeconfig=args.kubeconfig,
        node_labels=dict(args.node_label),
        root=args.root,
        reserve_bytes=args.reserve_bytes,
        tenant_files_bytes=args.tenant_files_bytes,
        huge_pages=HugePagesMode(args.huge_pages),
        drain_grace_seconds=args.drain_grace_seconds,
        populate_threads=args.populate_threads,
        populate_bytes_per_second=args.populate_rate,
        parallel_regions=args.parallel_regions,
        proc_scan=args.proc_scan,
        lock_table=args.lock_table,
        resync_seconds=args.resync_seconds,
        poll_seconds=args.poll_seconds,
        serve_http=not args.no_http,
        bind=args.bind,
        port=args.port,
        once=args.once,
        log_level=args.log_level,
    )


def parse_config(
    argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
) -> AgentConfig:
    """The command line (sys.argv's by default) and environment (os.environ's) as a config;
    exits 2 with the usage and the reason on anything the agent cannot run with."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return config_from_args(args, os.environ if environ is None else environ)
    except AgentConfigError as exc:
        parser.error(str(exc))


def run(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["mount-root"]:  # the chart's init container: kvshm.agent.root.mountroot
        return mount_root(argv[1:])
    config = parse_config(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):  # a console in any encoding never fails a pass
        sys.stdout.reconfigure(errors="backslashreplace")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=config.log_level.upper(), handlers=[handler])
    old_limit, limit = raise_soft_limit()  # before the event writer is spawned: it inherits it
    if limit != old_limit:
        log.info("raised the soft file descriptor limit from %d to %d", old_limit, limit)
    try:
        app = build_app(config)
    except AgentStartError as exc:
        print(f"kvshm-agent: {exc}", file=sys.stderr)
        return 2
    print(app.banner(), flush=True)
    for warning in app.warnings:
        log.warning("%s", warning)
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()
        app.loop.wakeup()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return app.run(stop)


def main() -> None:
    code = run()
    sys.stdout.flush()
    sys.stderr.flush()
    # Regions outlive the agent: skip waiting for populate threads and releasing mappings
    # (the files stay; the next start adopts and finishes them).
    os._exit(code)


if __name__ == "__main__":
    main()
