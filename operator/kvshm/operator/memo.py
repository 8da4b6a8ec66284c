"""kopf's memo as kvshm's handlers read it: one typed home for what start-up puts there.

kopf hands each object's handlers a shallow copy of the operator's memo, so the parts made at
start-up are shared by all, and what a handler sets (an OffloadNode's orphan clock) is that
object's own. Under `kopf run` the memo is kopf's plain Memo with the same keys, so this type
adds names and types, never behaviour (and no method a handler may call).
"""

from __future__ import annotations

import kopf

from kvshm.operator.book import RegionBook
from kvshm.operator.cluster import Snapshots
from kvshm.operator.config import OperatorConfig
from kvshm.operator.kube import ClusterWriter
from kvshm.operator.orphans import OrphanClock


class OperatorMemo(kopf.Memo):
    """The operator's memo: its config, and the parts start-up makes."""

    config: OperatorConfig  # main()'s; under kopf's CLI, start-up reads the environment's
    writer: ClusterWriter  # a test's, else start-up makes the Kubernetes client's
    views: Snapshots  # the cluster as decisions read it, at most SNAPSHOT_SECONDS old
    book: RegionBook  # the OffloadRegions' decisions and writes
    orphan_clock: OrphanClock  # an OffloadNode's memory between its sweeps


# Functions, not methods: under `kopf run` the memo is kopf's own Memo, which has neither.


def operator_config(memo: OperatorMemo) -> OperatorConfig:
    """The config, reading the environment's once where no main() put one in the memo."""
    config = memo.get("config")
    if not isinstance(config, OperatorConfig):
        config = memo.config = OperatorConfig.from_env()
    return config


def orphan_clock(memo: OperatorMemo) -> OrphanClock:
    """An OffloadNode's orphan clock from its last sweep, or a new one."""
    clock = memo.get("orphan_clock")
    return clock if isinstance(clock, OrphanClock) else OrphanClock()
