"""RegionAddress and NodeName: the names every key, directory and file name derive from."""

from __future__ import annotations

import pytest

from kvshm.api import InvalidAddressError, NodeName, RegionAddress, parse_offload_region
from kvshm.api.address import split_region_key
from kvshm.region import RegionFormat, RegionLayout

GIB = 2**30


def test_key_directory_and_file_0() -> None:
    address = RegionAddress("team", "r1", "eng-1")
    assert address.key == "team/r1" and address.directory == "team/r1"
    assert address.file_0_path == "team/r1/vllm_offload_eng-1.mmap"
    assert address.path_under("/dev/shm/kvshm/") == "/dev/shm/kvshm/team/r1/vllm_offload_eng-1.mmap"
    assert split_region_key(address.key) == ("team", "r1")


def test_file_names_are_the_layouts_own() -> None:
    layout = RegionLayout(6 * 1024, 2**20, 1, RegionFormat.VLLM_0_33)  # 6 GiB: 6 files
    address = RegionAddress("team", "r1", "eng-1")
    expected = [file.name for file in layout.files("eng-1")]
    assert address.file_names(layout) == expected and len(expected) == 6
    assert address.relative_paths(layout) == [f"team/r1/{name}" for name in expected]
    assert address.relative_paths(layout)[0] == address.file_0_path


def test_an_offload_regions_address_is_its_own() -> None:
    region = parse_offload_region(
        {
            "metadata": {"name": "r1", "namespace": "team"},
            "spec": {"instanceId": "eng-1", "layout": {"numBlocks": 4, "cpuPageSize": 4096}},
        }
    )
    assert region.address == RegionAddress("team", "r1", "eng-1")
    assert region.key == region.address.key


@pytest.mark.parametrize(
    ("namespace", "name", "instance_id"),
    [
        ("Team", "r1", "e"),
        ("team", "r_1", "e"),
        ("team", "r1", "../e"),
        ("team", "r1", "a..b"),
        ("team", "r1", ""),
        ("t" * 64, "r1", "e"),
    ],
)
def test_invalid_addresses_are_refused(namespace: str, name: str, instance_id: str) -> None:
    with pytest.raises(InvalidAddressError):
        RegionAddress(namespace, name, instance_id)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("team/r1/vllm_offload_eng-1.mmap", (RegionAddress("team", "r1", "eng-1"), 0)),
        ("team/r1/vllm_offload_eng-1.mmap.7", (RegionAddress("team", "r1", "eng-1"), 7)),
        ("team/r1/vllm_offload_eng-1.mmap.32", None),
        ("team/r1/other.mmap", None),
        ("r1/vllm_offload_e.mmap", None),
        ("team/r1/x/vllm_offload_e.mmap", None),
        ("../r1/vllm_offload_e.mmap", None),
        ("team/R1/vllm_offload_e.mmap", None),
    ],
)
def test_relative_paths_read_back(path: str, expected: tuple[RegionAddress, int] | None) -> None:
    assert RegionAddress.from_relative_path(path) == expected


def test_node_names() -> None:
    longest = ".".join(["a" * 63] * 4)[:253]
    assert NodeName(longest) == longest and isinstance(NodeName("node-a"), str)
    for bad in ("Node-A", "", "a" * 254, "node_a", "-a"):
        with pytest.raises(InvalidAddressError):
            NodeName(bad)
        assert NodeName.parse(bad) is None
    assert NodeName.parse(7) is None
