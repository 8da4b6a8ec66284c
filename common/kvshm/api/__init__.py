"""The kvshm.dev/v1alpha1 custom resources as typed values, shared by agent, operator and CLI:
OffloadRegion's spec (offload_region), the status contract between agent and operator
(status: OffloadRegion's reports; offload_node: OffloadNode's records; reading: how both are
read back), and the names paths and keys derive from (address).

The CRDs in charts/kvshm/crds/ are the API server's source of truth; parsing here applies the
same defaults and rules, so local mode (YAML files, no API server) accepts exactly what the
cluster accepts, and the agent re-checks what it is given before it touches the filesystem.
"""

from kvshm.api.address import InvalidAddressError, NodeName, RegionAddress, region_key
from kvshm.api.offload_node import (
    HugePages,
    InventoryFile,
    NodeInventory,
    OffloadNode,
    ReclaimRequest,
    ReclaimResult,
    RetainedFile,
    RootPages,
    parse_offload_node,
)
from kvshm.api.offload_region import (
    GROUP,
    NODE_KIND,
    NODE_PLURAL,
    REGION_KIND,
    REGION_PLURAL,
    VERSION,
    NodeRegionPhase,
    OffloadRegion,
    ReclaimOutcome,
    ReclaimPolicy,
    RegionAccess,
    RegionNuma,
    RegionPhase,
    RegionPlacement,
    SpecError,
    WarmIndexState,
    parse_offload_region,
)
from kvshm.api.status import NodeReport, WarmIndexReport, parse_node_reports

__all__ = [
    "GROUP",
    "NODE_KIND",
    "NODE_PLURAL",
    "REGION_KIND",
    "REGION_PLURAL",
    "VERSION",
    "HugePages",
    "InvalidAddressError",
    "InventoryFile",
    "NodeInventory",
    "NodeName",
    "NodeRegionPhase",
    "NodeReport",
    "OffloadNode",
    "OffloadRegion",
    "ReclaimOutcome",
    "ReclaimPolicy",
    "ReclaimRequest",
    "ReclaimResult",
    "RegionAccess",
    "RegionAddress",
    "RegionNuma",
    "RegionPhase",
    "RegionPlacement",
    "RetainedFile",
    "RootPages",
    "SpecError",
    "WarmIndexReport",
    "WarmIndexState",
    "parse_node_reports",
    "parse_offload_node",
    "parse_offload_region",
    "region_key",
]
