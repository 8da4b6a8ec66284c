"""NUMA placement of a region's pages: the host's nodes and GPUs read from sysfs, the rules of
kvshm.agent.topology, and the agent applying them to real files.

This machine has one NUMA node and no GPU: there the agent places nothing, whatever the spec
asks (the tests say so on the real sysfs). The rules for hosts of several nodes are checked on
sysfs trees written as such hosts have them; the mechanism end to end with such a topology
handed to the agent, binding to node 0, the one node this machine can bind to."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshm.agent.topology import HostTopology, NumaSpecError, choose, normal_pci_address
from kvshm.api import NodeRegionPhase, RegionNuma
from kvshm.region import SharedOffloadRegion, memory
from kvshm.region.numa import NumaPlacement, NumaPolicy, placement
from tests.agent.builders import make_reconciler, region, view
from tests.agent.test_huge_pages import ready_messages, settled_events

UUID_0 = "GPU-00000000-1111-2222-3333-444444444444"


def write_host(
    sysfs: Path, nodes: str, gpus: dict[str, int], others: tuple[str, ...] = ()
) -> tuple[Path, Path]:
    """A sysfs (and the NVIDIA driver's /proc) of a host with these online nodes, these NVIDIA
    GPUs (PCI address -> numa_node) and other PCI devices: (sysfs, procfs)."""
    (sysfs / "devices" / "system" / "node").mkdir(parents=True)
    (sysfs / "devices" / "system" / "node" / "online").write_text(nodes + "\n")
    procfs = sysfs.parent / "proc"
    for address, (vendor, pci_class, node) in {
        **{a: ("0x10de", "0x030200", n) for a, n in gpus.items()},
        **{a: ("0x8086", "0x020000", 0) for a in others},  # a network card, say
    }.items():
        device = sysfs / "bus" / "pci" / "devices" / address
        device.mkdir(parents=True)
        (device / "vendor").write_text(vendor + "\n")
        (device / "class").write_text(pci_class + "\n")
        (device / "numa_node").write_text(f"{node}\n")
    for index, address in enumerate(gpus):
        info = procfs / "driver" / "nvidia" / "gpus" / address
        info.mkdir(parents=True)
        uuid = UUID_0.replace("0000", f"{index:04d}", 1)
        (info / "information").write_text(f"Model: \t NVIDIA H200\nGPU UUID: \t {uuid}\n")
    return sysfs, procfs


@pytest.fixture
def two_sockets(tmp_path: Path) -> HostTopology:
    """8 GPUs over 2 sockets, as an HGX host lists them."""
    gpus = {
        f"0000:{bus:02x}:00.0": 0 if i < 4 else 1 for i, bus in enumerate(range(0x18, 0x98, 0x10))
    }
    sysfs, procfs = write_host(tmp_path / "sys", "0-1", gpus, ("0000:03:00.0",))
    return HostTopology.read(str(sysfs), str(procfs))


def test_gpus_nodes_and_uuids_are_read_from_sysfs(two_sockets: HostTopology) -> None:
    assert two_sockets.nodes == (0, 1)
    assert [gpu.numa_node for gpu in two_sockets.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    first = two_sockets.gpus[0]
    assert first.pci == "0000:18:00.0" and first.uuid == UUID_0
    assert two_sockets.find_gpu("18:00.0") == first
    assert two_sockets.find_gpu("00000000:18:00.0") == first  # as nvidia-smi writes it
    assert two_sockets.find_gpu(UUID_0.lower()) == first
    assert normal_pci_address("00000000:1B:00.0") == "0000:1b:00.0"


def test_a_regions_gpus_bind_its_pages_to_their_node(two_sockets: HostTopology) -> None:
    chosen = choose(RegionNuma(gpus=("0000:58:00.0", "0000:88:00.0")), two_sockets)
    assert chosen.placement == NumaPlacement((1,), NumaPolicy.BIND)
    # GPUs of both sockets: interleaved over both
    both = choose(RegionNuma(gpus=("0000:18:00.0", "0000:88:00.0")), two_sockets)
    assert both.placement == NumaPlacement((0, 1), NumaPolicy.INTERLEAVE)


def test_nodes_named_directly_bind_and_a_node_the_host_lacks_is_refused(
    two_sockets: HostTopology,
) -> None:
    assert choose(RegionNuma(nodes=(0,)), two_sockets).placement == NumaPlacement((0,))
    with pytest.raises(
        NumaSpecError, match=r"NUMA node 2, which this host does not have \(online: 0,1\)"
    ):
        choose(RegionNuma(nodes=(0, 2)), two_sockets)


def test_a_gpu_the_host_lacks_is_refused_listing_the_ones_it_has(two_sockets: HostTopology) -> None:
    with pytest.raises(NumaSpecError) as refused:
        choose(RegionNuma(gpus=("0000:99:00.0",)), two_sockets)
    message = str(refused.value)
    assert "names 0000:99:00.0, which this host does not have" in message
    assert f"0000:18:00.0 ({UUID_0}) on NUMA node 0" in message
    assert "0000:03:00.0" not in message  # not a GPU


def test_without_a_spec_gpus_split_over_sockets_place_nothing(two_sockets: HostTopology) -> None:
    chosen = choose(None, two_sockets)
    assert chosen.placement is None and "set spec.numa" in chosen.reason


def test_without_a_spec_the_one_node_of_every_gpu_is_preferred(tmp_path: Path) -> None:
    sysfs, procfs = write_host(tmp_path / "sys", "0-1", {"0000:c1:00.0": 1, "0000:c2:00.0": 1})
    chosen = choose(None, HostTopology.read(str(sysfs), str(procfs)))
    assert chosen.placement == NumaPlacement((1,), NumaPolicy.PREFERRED)


def test_a_platform_without_numa_nodes_for_its_gpus_places_nothing(tmp_path: Path) -> None:
    sysfs, procfs = write_host(tmp_path / "sys", "0-1", {"0000:c1:00.0": -1})
    chosen = choose(RegionNuma(gpus=("c1:00.0",)), HostTopology.read(str(sysfs), str(procfs)))
    assert chosen.placement is None and "no NUMA node" in chosen.reason


def test_one_numa_node_places_nothing_whatever_the_spec_says(tmp_path: Path) -> None:
    sysfs, procfs = write_host(tmp_path / "sys", "0", {"0000:c1:00.0": 0})
    host = HostTopology.read(str(sysfs), str(procfs))
    for numa in (None, RegionNuma(nodes=(0,)), RegionNuma(gpus=("c1:00.0",))):
        chosen = choose(numa, host)
        assert chosen.placement is None and "one NUMA node" in chosen.reason


def test_this_machine_is_one_numa_node_and_the_agent_leaves_its_regions_pages_alone(
    shm_dir: Path,
) -> None:
    """The real sysfs: one node, so a region asking for node 0 gets the kernel's default
    policy on its file (no mbind at all), and every page is on node 0."""
    host = HostTopology.read()
    assert host.nodes == (0,)
    root = shm_dir / "root"
    reconciler = make_reconciler(root)  # the host's own topology
    r1 = region(numa={"nodes": [0]})
    result, events = settled_events(reconciler, view(r1))
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.READY
    assert "placed on" not in ready_messages(events)[0]
    with SharedOffloadRegion(
        "r1", r1.layout, directory=str(root / "ns1" / "r1"), mode="attach", populate=False
    ) as mine:
        policies, _ = placement(mine.address, r1.size_bytes)
        assert policies == {"default"}


def test_a_node_this_machine_lacks_fails_the_region_with_what_it_has(shm_dir: Path) -> None:
    reconciler = make_reconciler(shm_dir / "root")
    result, _ = settled_events(reconciler, view(region(numa={"nodes": [7]})))
    report = result.reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.FAILED
    assert "spec.numa.nodes names NUMA node 7, which this host does not have" in report.message
    assert not (shm_dir / "root" / "ns1" / "r1").exists()


def test_a_topology_of_two_sockets_binds_the_regions_file_as_the_kernel_then_shows(
    shm_dir: Path, tmp_path: Path
) -> None:
    """The mechanism end to end: the agent told the host is two sockets with the region's GPU
    on node 0 binds the file's pages there (mbind), which numa_maps shows from another
    process's mapping of it, and the Ready event says where the pages went."""
    sysfs, procfs = write_host(tmp_path / "sys", "0-1", {"0000:18:00.0": 0, "0000:88:00.0": 1})
    root = shm_dir / "root"
    reconciler = make_reconciler(root, topology=HostTopology.read(str(sysfs), str(procfs)))
    r1 = region(numa={"gpus": ["0000:18:00.0"]})
    result, events = settled_events(reconciler, view(r1))
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.READY
    [ready] = ready_messages(events)
    assert (
        "placed on NUMA node 0 (bind), the NUMA node of GPU 0000:18:00.0: 2.0 MiB on node 0"
        in ready
    )
    with SharedOffloadRegion(
        "r1", r1.layout, directory=str(root / "ns1" / "r1"), mode="attach", populate=False
    ) as mine:
        memory.madvise(mine.address, r1.size_bytes, memory.MADV_POPULATE_WRITE)  # maps, no more
        assert placement(mine.address, r1.size_bytes) == ({"bind:0"}, {0: r1.size_bytes})
