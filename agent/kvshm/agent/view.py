"""What a region source tells the reconciler: the regions it knows, this node, the reclaims."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvshm.api import OffloadRegion, ReclaimRequest, RegionAddress


@dataclass(frozen=True)
class KnownRegion:
    region: OffloadRegion
    deleting: bool = False  # metadata.deletionTimestamp is set: drain it everywhere
    # status.nodes.<this node> is there and not Removed: as far as the cluster knows, this node
    # may still hold the region's files (cluster mode; a local source has no such report)
    reported_holding: bool = False


@dataclass(frozen=True)
class ClusterView:
    node_name: str
    node_labels: Mapping[str, str] = field(default_factory=dict)
    regions: Mapping[str, KnownRegion] = field(default_factory=dict)  # "<ns>/<name>" -> region
    invalid: Mapping[str, str] = field(default_factory=dict)  # key -> why its spec was refused
    reclaims: Sequence[ReclaimRequest] = ()
    problems: Sequence[str] = ()  # source-level trouble (an unreadable file, a lost watch)
    # paths the operator decides from whether the inventory lists them (this node's
    # spec.retained and spec.reclaims): looked up by name, not only listed (InventoryScanner)
    listed_first: frozenset[str] = frozenset()

    def placed_here(self) -> dict[str, OffloadRegion]:
        """The regions this node must hold: placed here and not being deleted."""
        return {
            key: known.region
            for key, known in self.regions.items()
            if not known.deleting
            and known.region.placement.matches(self.node_name, self.node_labels)
        }

    def claimant(self, address: RegionAddress) -> str:
        """Key of the region that names this file; an unreadable spec claims its directory."""
        key = address.key
        known = self.regions.get(key)
        if known is not None and known.region.instance_id == address.instance_id:
            return key
        return key if key in self.invalid else ""
