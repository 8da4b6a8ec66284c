"""What one reconcile pass hands the sinks: the status records it produced (kvshm.api.status,
the contract with the operator), the root scan, and Events. Sinks turn them into API patches
or console lines."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvshm.agent.inventory import RootScan
from kvshm.agent.tenantfiles import TenantFiles
from kvshm.api import NodeReport, ReclaimResult
from kvshm.api.events import EventReason

WARNING_REASONS = frozenset(
    {EventReason.FAILED, EventReason.LOCK_FAILED, EventReason.RECLAIM_REFUSED}
)


@dataclass(frozen=True)
class AgentEvent:
    """Something worth a Kubernetes Event: about a region (region_key) or the node ("")."""

    reason: EventReason
    message: str
    region_key: str = ""
    region_uid: str = ""

    @property
    def warning(self) -> bool:
        return self.reason in WARNING_REASONS


@dataclass
class PassResult:
    """Everything one reconcile pass found and did."""

    reports: dict[str, NodeReport] = field(default_factory=dict)  # region key -> its report
    events: list[AgentEvent] = field(default_factory=list)
    root_scan: RootScan | None = None  # the region root as found, and its OffloadNode inventory
    reclaims: dict[str, ReclaimResult] = field(default_factory=dict)  # path -> latest result
    # Ready region key -> what its tenant keeps in its directory besides it
    tenant_files: dict[str, TenantFiles] = field(default_factory=dict)
    problems: tuple[str, ...] = ()  # the source's (unreadable files, refused specs)
    busy: bool = False  # something is populating or draining: pass again soon
    settled: bool = True  # nothing in progress (local --once may stop)
