"""The cluster snapshot the decisions share: copied from kopf's indexes at most once per
max_age, its clock always current."""

from __future__ import annotations

import dataclasses
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


def test_the_region_path_sets_are_built_once_a_snapshot_for_every_decision() -> None:
    regions = {f"team/r{i}": f"/dev/shm/kvshm/team/r{i}/vllm_offload_r{i}.mmap" for i in range(3)}
    live = dict(list(regions.items())[:2])
    built = 0

    def build() -> ClusterSnapshot:
        nonlocal built
        built += 1
        snapshot = cluster(["a"], regions=regions)
        return dataclasses.replace(snapshot, live_regions=live)

    views = Snapshots(build, max_age=60)
    first, second = views.get(), views.get()
    assert first.region_paths == frozenset(regions.values())
    assert first.live_region_paths == frozenset(live.values())
    assert second.region_paths is first.region_paths  # shared, not rebuilt per decision
    assert second.live_region_paths is first.live_region_paths
    assert views.get(fresh=True).region_paths is not first.region_paths and built == 2
