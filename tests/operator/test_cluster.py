"""The cluster snapshot the decisions share: copied from kopf's indexes at most once per
max_age, its clock always current."""

from __future__ import annotations

import time

from kvshm.operator.cluster import ClusterSnapshot, Snapshots
from tests.operator.builders import cluster


def test_a_snapshot_is_shared_for_its_max_age_with_a_current_clock() -> None:
    built: list[ClusterSnapshot] = []

    def build() -> ClusterSnapshot:
        built.append(cluster(["a"]))
        return built[-1]

    views = Snapshots(build, max_age=0.2)
    first, second = views.get(), views.get()
    assert len(built) == 1 and first.nodes is second.nodes
    assert first.now > built[0].now  # the builder's clock is the tests' fixed NOW
    time.sleep(0.25)
    views.get()
    assert len(built) == 2
    fresh = views.get(fresh=True)  # copied now, whatever the shared one's age
    assert len(built) == 3 and views.get().nodes is fresh.nodes
