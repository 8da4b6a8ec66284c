"""The agent's settings as one typed value, validated once: kvshm.agent.cli builds it from the
command line and the environment, and everything that starts the agent takes it from there.

The messages name the command-line flag, since that is where every value comes from.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kvshm.agent.root.rootpages import HugePagesMode
from kvshm.agent.tenantfiles import DEFAULT_ALLOWANCE_BYTES

DEFAULT_ROOT = "/dev/shm/kvshm"
DEFAULT_PORT = 9464
LOG_LEVELS = ("debug", "info", "warning", "error")


class AgentConfigError(ValueError):
    """A setting the agent cannot run with; the message names the flag and what it takes."""


@dataclass(frozen=True)
class AgentConfig:
    node_name: str
    # Local mode: a directory of OffloadRegion YAML files (no cluster). None: cluster mode.
    local: str | None = None
    kubeconfig: str | None = None  # cluster mode; None: in-cluster config
    node_labels: Mapping[str, str] = field(default_factory=dict)  # local mode's placement
    root: str = DEFAULT_ROOT
    reserve_bytes: int = 0
    # what a tenant may keep in its region directory besides the region and its index
    tenant_files_bytes: int = DEFAULT_ALLOWANCE_BYTES
    huge_pages: HugePagesMode = HugePagesMode.WARN
    drain_grace_seconds: float = 30.0
    populate_threads: int | None = None  # None: one per CPU, at most 8
    populate_bytes_per_second: int | None = None  # None: as fast as the machine goes
    parallel_regions: int = 1
    proc_scan: bool = False
    # flock holders are counted from this table; in a pod, the host's (a procfs lists only the
    # locks of the processes its PID namespace sees)
    lock_table: str = "/proc/locks"
    resync_seconds: float = 30.0
    poll_seconds: float = 1.0  # local mode: how often the directory is read
    serve_http: bool = True
    bind: str | None = None  # None: 127.0.0.1 in local mode, else 0.0.0.0
    port: int = DEFAULT_PORT  # 0: any free port
    once: bool = False  # reconcile until settled, then exit
    log_level: str = "info"

    def __post_init__(self) -> None:
        # read-only, so the frozen config cannot change under the code that holds it
        object.__setattr__(self, "node_labels", MappingProxyType(dict(self.node_labels)))
        if not self.node_name:
            raise AgentConfigError("--node-name must not be empty (nor $NODE_NAME)")
        if not self.root:
            raise AgentConfigError("--root must not be empty")
        if self.local is not None and self.kubeconfig is not None:
            raise AgentConfigError("--kubeconfig is for cluster mode: --local reads no cluster")
        if self.node_labels and self.local is None:
            raise AgentConfigError(
                "--node-label is for local mode: in a cluster the Node's own labels count"
            )
        _at_least("--reserve-bytes", self.reserve_bytes, 0)
        _at_least("--tenant-files-bytes", self.tenant_files_bytes, 0)
        try:
            object.__setattr__(self, "huge_pages", HugePagesMode(self.huge_pages))
        except ValueError:
            choices = ", ".join(mode.value for mode in HugePagesMode)
            raise AgentConfigError(
                f"--huge-pages must be one of {choices}, got {self.huge_pages!r}"
            ) from None
        _at_least("--drain-grace-seconds", self.drain_grace_seconds, 0)
        _at_least("--parallel-regions", self.parallel_regions, 1)
        if self.populate_threads is not None:
            _at_least("--populate-threads", self.populate_threads, 1)
        if self.populate_bytes_per_second is not None:
            _greater_than_zero("--populate-rate", self.populate_bytes_per_second)
        _greater_than_zero("--resync-seconds", self.resync_seconds)
        _greater_than_zero("--poll-seconds", self.poll_seconds)
        if not 0 <= self.port <= 65535:
            raise AgentConfigError(f"--port must be 0 to 65535, got {self.port}")
        if self.log_level not in LOG_LEVELS:
            raise AgentConfigError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")

    @property
    def http_host(self) -> str:
        """Where /metrics, /healthz and /readyz are served: only this machine in local mode."""
        if self.bind:
            return self.bind
        return "127.0.0.1" if self.local is not None else "0.0.0.0"


def _at_least(flag: str, value: float, minimum: float) -> None:
    if value < minimum:
        raise AgentConfigError(f"{flag} must be at least {minimum}, got {value}")


def _greater_than_zero(flag: str, value: float) -> None:
    if value <= 0:
        raise AgentConfigError(f"{flag} must be greater than 0, got {value}")
