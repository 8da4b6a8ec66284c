"""The kvshm.dev/v1alpha1 custom resources as typed values, shared by agent, operator and CLI.

The CRDs in charts/kvshm/crds/ are the API server's source of truth; parsing here applies the
same defaults and rules, so local mode (YAML files, no API server) accepts exactly what the
cluster accepts, and the agent re-checks what it is given before it touches the filesystem.
"""

from kvshm.api.resources import (
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
    RegionPhase,
    RegionPlacement,
    SpecError,
    parse_offload_region,
)

__all__ = [
    "GROUP",
    "NODE_KIND",
    "NODE_PLURAL",
    "REGION_KIND",
    "REGION_PLURAL",
    "VERSION",
    "NodeRegionPhase",
    "OffloadRegion",
    "ReclaimOutcome",
    "ReclaimPolicy",
    "RegionAccess",
    "RegionPhase",
    "RegionPlacement",
    "SpecError",
    "parse_offload_region",
]
