"""A region's NUMA policy (mbind before populate) on real tmpfs files, read back from the
kernel's numa_maps. This machine has one NUMA node, so binding to node 0 is all that can be
placed; the policy itself, its persistence in the file and the errors are real."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.agent_region import attach_as_worker

from kvshm.region import RegionLayout, SharedOffloadRegion
from kvshm.region.numa import (
    NumaError,
    NumaPlacement,
    NumaPolicy,
    online_nodes,
    parse_node_list,
    placement,
)

MIB = 1 << 20
LAYOUT = RegionLayout(8, MIB, 2)


def test_node_lists_read_as_the_kernel_writes_them(tmp_path: Path) -> None:
    assert parse_node_list("0\n") == (0,)
    assert parse_node_list("0-2,5,7-8") == (0, 1, 2, 5, 7, 8)
    online = tmp_path / "online"
    online.write_text("0-1\n")
    assert online_nodes(str(online)) == (0, 1)
    assert online_nodes(str(tmp_path / "missing")) == (0,)  # no NUMA support: one node


def test_a_region_bound_to_a_node_has_its_pages_there_and_the_file_keeps_the_policy(
    shm_dir: Path,
) -> None:
    bound = NumaPlacement((0,), NumaPolicy.BIND)
    with SharedOffloadRegion(
        "n", LAYOUT, directory=str(shm_dir), mode="create", numa=bound
    ) as creator:
        policies, on_node = placement(creator.address, LAYOUT.size_bytes)
        assert policies == {"bind:0"}
        assert on_node == {0: LAYOUT.size_bytes}
        # the policy belongs to the file (its shared policy): another process's mapping of it
        # shows it too, so what an engine allocates later in a sparse region follows it
        worker = attach_as_worker(shm_dir, "n", LAYOUT, 1)
        try:
            assert placement(worker.address, LAYOUT.size_bytes)[0] == {"bind:0"}
        finally:
            worker.cleanup()


def test_without_a_placement_the_kernels_default_policy_stays(shm_dir: Path) -> None:
    with SharedOffloadRegion("d", LAYOUT, directory=str(shm_dir), mode="create") as creator:
        assert placement(creator.address, LAYOUT.size_bytes)[0] == {"default"}


def test_a_node_the_host_does_not_have_is_refused_naming_it(shm_dir: Path) -> None:
    missing = max(online_nodes()) + 1
    with pytest.raises(NumaError, match=f"NUMA node\\(s\\) {missing} \\(bind\\) failed"):
        SharedOffloadRegion(
            "x",
            LAYOUT,
            directory=str(shm_dir),
            mode="create",
            numa=NumaPlacement((missing,), NumaPolicy.BIND),
        )
    assert list(shm_dir.iterdir()) == []  # the creator that failed removed its file
