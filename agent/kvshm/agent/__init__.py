"""kvshm.agent: the node agent. It creates, populates, locks, drains and removes region files
under the region root, from OffloadRegion resources (cluster mode) or YAML files (local mode)."""

from kvshm.agent.reconciler import NodeReconciler, ReconcilerSettings
from kvshm.agent.reports import PassResult
from kvshm.agent.root.saferoot import RegionRoot
from kvshm.agent.view import ClusterView, KnownRegion

__all__ = [
    "ClusterView",
    "KnownRegion",
    "NodeReconciler",
    "PassResult",
    "ReconcilerSettings",
    "RegionRoot",
]
