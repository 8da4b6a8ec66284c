"""Assembling an agent from its config: root, source and sink, reconciler, loop, server.

The CLI and the tests build agents here, so what the tests run is what `kvshm-agent` runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime

from kvshm.agent.config import AgentConfig
from kvshm.agent.drain.eventwriter import IsolatedEventQueues
from kvshm.agent.errors import describe
from kvshm.agent.hosting import HostingSettings
from kvshm.agent.local.console import ConsoleSink
from kvshm.agent.local.source import LocalDirectorySource
from kvshm.agent.loop import AgentLoop, RegionSource, StatusSink, Wakeup
from kvshm.agent.metrics import AgentMetrics
from kvshm.agent.reconciler import NodeReconciler, ReconcilerSettings
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.root.rootpages import HugePagesMode, describe_pages, is_huge, missing_huge_pages
from kvshm.agent.root.saferoot import RegionRoot
from kvshm.agent.server import Health, serve
from kvshm.agent.version import agent_version
from kvshm.api import NodeRegionPhase
from kvshm.endpoints import BoundedHttpServer
from kvshm.region import RegionError


class AgentStartError(Exception):
    """The agent cannot start; the message says why and what to do."""


@dataclass
class AgentApp:
    config: AgentConfig
    root: RegionRoot
    metrics: AgentMetrics
    reconciler: NodeReconciler
    events: IsolatedEventQueues
    loop: AgentLoop
    server: BoundedHttpServer | None
    warnings: tuple[str, ...] = ()  # to log once the banner is out (the root's pages)

    def banner(self) -> str:
        local = self.config.local
        mode = f"local mode, regions from {local}" if local is not None else "cluster mode"
        where = ""
        if self.server is not None:
            host, port = self.server.server_address[:2]
            where = f", metrics on http://{host!s}:{port}/metrics"
        return (
            f"kvshm-agent {agent_version()}: {mode}, root {self.root.path} "
            f"({describe_pages(self.root.pages)}), node {self.config.node_name}{where}"
        )

    def run(self, stop: threading.Event) -> int:
        """Reconcile until stop (or, config.once, until settled). Exit code 1 if once and any
        region failed. Nothing is released: the regions stay for the next start to adopt."""
        once = self.config.once
        result = self.loop.run(stop, until_settled=once)
        self.loop.source.close()
        self.loop.sink.close()
        self.events.shutdown()  # the writer child; its rings stay for the next start
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
        failed = result is not None and any(
            report.phase is NodeRegionPhase.FAILED for report in result.reports.values()
        )
        return 1 if once and failed else 0


def _settings(config: AgentConfig) -> ReconcilerSettings:
    return ReconcilerSettings(
        reserve_bytes=config.reserve_bytes,
        tenant_files_bytes=config.tenant_files_bytes,
        huge_pages_wanted=config.huge_pages is not HugePagesMode.IGNORE,
        drain_grace_seconds=config.drain_grace_seconds,
        retry_seconds=config.resync_seconds,
        hosting=HostingSettings(
            config.populate_threads, config.populate_bytes_per_second, config.parallel_regions
        ),
    )


def _check_pages(config: AgentConfig, root: RegionRoot) -> tuple[str, ...]:
    """--huge-pages: refuse to start (require), or the warning to give (warn), when region
    files get no huge pages on the root."""
    if is_huge(root.pages) or config.huge_pages is HugePagesMode.IGNORE:
        return ()
    why = missing_huge_pages(root.path, root.pages)
    if config.huge_pages is HugePagesMode.REQUIRE:
        root.close()
        raise AgentStartError(f"--huge-pages require: {why}")
    return (why,)


def _connect(
    config: AgentConfig, metrics: AgentMetrics
) -> tuple[RegionSource, StatusSink, dict[str, datetime]]:
    """The chosen mode's source and sink, and orphaned-since times to carry over."""
    if config.local is not None:
        source = LocalDirectorySource(
            config.local, config.node_name, config.node_labels, poll_seconds=config.poll_seconds
        )
        return source, ConsoleSink(progress_seconds=1.0), {}
    # imported here: local mode never loads the kubernetes client (start-up time, memory)
    from kvshm.agent.cluster.connect import connect_cluster

    return connect_cluster(
        config.node_name,
        config.kubeconfig,
        metrics,
        agent_version(),
        resync_seconds=config.resync_seconds,
    )


def build_app(config: AgentConfig) -> AgentApp:
    try:
        root = RegionRoot(config.root)
    except (RegionError, OSError) as exc:
        raise AgentStartError(f"cannot use the region root: {describe(exc)}") from exc
    warnings = _check_pages(config, root)
    metrics = AgentMetrics(agent_version())
    try:
        source, sink, orphaned_since = _connect(config, metrics)
    except Exception as exc:  # a bad kubeconfig, an unreachable API, RBAC: say so and stop
        root.close()
        raise AgentStartError(f"cannot start: {exc}") from exc
    wakeup = Wakeup()
    events = IsolatedEventQueues()
    reconciler = NodeReconciler(
        root,
        events,
        _settings(config),
        holds=HoldChecker(proc_scan=config.proc_scan, lock_table=config.lock_table),
        counters=metrics,
        wake=wakeup,
    )
    reconciler.seed_orphaned_since(orphaned_since)
    health = Health(stale_after_seconds=max(60.0, 3 * config.resync_seconds))
    server = None
    if config.serve_http:
        host = config.http_host
        try:
            server = serve(host, config.port, metrics.registry, health)
        except OSError as exc:
            source.close()
            root.close()
            raise AgentStartError(
                f"cannot serve /metrics on {host}:{config.port} ({exc.strerror or exc}): is "
                f"another agent running? Use --port 0 for any free port, or --no-http"
            ) from exc
    loop = AgentLoop(
        source, reconciler, sink, metrics, health, wakeup, resync_seconds=config.resync_seconds
    )
    return AgentApp(config, root, metrics, reconciler, events, loop, server, warnings)
