"""Where on the host a region's pages go: the host's NUMA nodes and GPUs as sysfs lists them,
and the NUMA placement a region gets from them and its spec.numa.

The agent imports no GPU stack, so GPUs are found as the kernel lists them: PCI devices of
NVIDIA's vendor id in a display-controller class (/sys/bus/pci/devices/*/vendor, class), each
with its NUMA node (numa_node; -1 where the platform gives none) and, where the NVIDIA driver
is loaded, its UUID (/proc/driver/nvidia/gpus/<address>/information).

The rule (docs/agent.md, "NUMA"): spec.numa.nodes binds the pages to those nodes (interleaved
over several); spec.numa.gpus does so for the nodes of those GPUs; without spec.numa the pages
prefer the node of the host's GPUs when they all share one, and go where the kernel puts them
otherwise. A host of one NUMA node places nothing: every page is on that node anyway.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvshm.api import RegionNuma
from kvshm.region.numa import NumaPlacement, NumaPolicy, online_nodes

NVIDIA_VENDOR = 0x10DE
DISPLAY_CLASSES = (0x0300, 0x0302)  # VGA-compatible and 3D controllers: NVIDIA's GPUs
_UUID_LINE = re.compile(r"^GPU UUID:\s*(\S+)", re.MULTILINE)


class NumaSpecError(ValueError):
    """spec.numa cannot be followed on this host; the message says what it has instead."""


@dataclass(frozen=True)
class Gpu:
    pci: str  # 0000:1b:00.0, as sysfs names it
    numa_node: int | None  # None where the platform gives the device none (-1)
    uuid: str = ""


def normal_pci_address(address: str) -> str:
    """0000:1b:00.0 from 1B:00.0, 00000000:1B:00.0 (nvidia-smi) or 0000:1b:00.0."""
    parts = address.lower().split(":")
    domain = int(parts[0], 16) if len(parts) == 3 else 0
    return f"{domain:04x}:{parts[-2]}:{parts[-1]}"


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as file:
            return file.read().strip()
    except OSError:
        return ""


@dataclass(frozen=True)
class HostTopology:
    nodes: tuple[int, ...]  # online NUMA nodes
    gpus: tuple[Gpu, ...]

    @classmethod
    def read(cls, sysfs: str = "/sys", procfs: str = "/proc") -> HostTopology:
        devices = os.path.join(sysfs, "bus", "pci", "devices")
        gpus = []
        try:
            addresses = sorted(os.listdir(devices))
        except OSError:
            addresses = []
        for address in addresses:
            device = os.path.join(devices, address)
            try:
                vendor = int(_read(os.path.join(device, "vendor")) or "0", 16)
                pci_class = int(_read(os.path.join(device, "class")) or "0", 16) >> 8
                node = int(_read(os.path.join(device, "numa_node")) or "-1")
            except ValueError:
                continue
            if vendor != NVIDIA_VENDOR or pci_class not in DISPLAY_CLASSES:
                continue
            info = _read(os.path.join(procfs, "driver", "nvidia", "gpus", address, "information"))
            uuid = _UUID_LINE.search(info)
            gpus.append(Gpu(address, node if node >= 0 else None, uuid.group(1) if uuid else ""))
        return cls(
            online_nodes(os.path.join(sysfs, "devices", "system", "node", "online")), tuple(gpus)
        )

    def find_gpu(self, name: str) -> Gpu | None:
        if name.upper().startswith("GPU-"):
            return next((gpu for gpu in self.gpus if gpu.uuid.lower() == name.lower()), None)
        pci = normal_pci_address(name)
        return next((gpu for gpu in self.gpus if gpu.pci == pci), None)

    def describe_gpus(self) -> str:
        if not self.gpus:
            return "no NVIDIA GPU in /sys/bus/pci/devices"
        return ", ".join(
            f"{gpu.pci}{f' ({gpu.uuid})' if gpu.uuid else ''} on NUMA node "
            f"{'none' if gpu.numa_node is None else gpu.numa_node}"
            for gpu in self.gpus
        )


@dataclass(frozen=True)
class NumaChoice:
    """The placement a region gets here (None: the kernel's default), and why, for messages."""

    placement: NumaPlacement | None
    reason: str


def choose(numa: RegionNuma | None, host: HostTopology) -> NumaChoice:
    """The placement of a region with this spec.numa on this host; NumaSpecError where the
    spec names a node or GPU the host does not have."""
    if numa is not None and numa.nodes:
        missing = [node for node in numa.nodes if node not in host.nodes]
        if missing:
            raise NumaSpecError(
                f"spec.numa.nodes names NUMA node {','.join(map(str, missing))}, which this "
                f"host does not have (online: {','.join(map(str, host.nodes))})"
            )
        return _placed(numa.nodes, host, "as spec.numa.nodes says")
    if numa is not None:
        return _for_gpus(numa.gpus, host)
    return _default(host)


def _placed(nodes: Sequence[int], host: HostTopology, why: str) -> NumaChoice:
    if len(host.nodes) == 1:
        return NumaChoice(None, f"one NUMA node on this host: every page is on it ({why})")
    chosen = tuple(sorted(set(nodes)))
    policy = NumaPolicy.BIND if len(chosen) == 1 else NumaPolicy.INTERLEAVE
    return NumaChoice(NumaPlacement(chosen, policy), why)


def _for_gpus(names: Sequence[str], host: HostTopology) -> NumaChoice:
    found = {name: host.find_gpu(name) for name in names}
    missing = [name for name, gpu in found.items() if gpu is None]
    if missing:
        raise NumaSpecError(
            f"spec.numa.gpus names {', '.join(missing)}, which this host does not have: it has "
            f"{host.describe_gpus()}"
        )
    gpus = [gpu for gpu in found.values() if gpu is not None]
    unplaced = [gpu.pci for gpu in gpus if gpu.numa_node is None]
    if unplaced:
        return NumaChoice(
            None, f"the platform gives GPU {', '.join(unplaced)} no NUMA node: nothing to place"
        )
    nodes = [gpu.numa_node for gpu in gpus if gpu.numa_node is not None]
    return _placed(nodes, host, f"the NUMA node of GPU {', '.join(gpu.pci for gpu in gpus)}")


def _default(host: HostTopology) -> NumaChoice:
    nodes = {gpu.numa_node for gpu in host.gpus}
    if len(host.nodes) == 1:
        return NumaChoice(None, "one NUMA node on this host: every page is on it")
    if len(nodes) != 1 or None in nodes:
        return NumaChoice(
            None,
            f"the host's GPUs are not all on one NUMA node ({host.describe_gpus()}): the pages "
            f"go where the kernel puts them; set spec.numa to place them",
        )
    (node,) = nodes
    assert node is not None
    return NumaChoice(
        NumaPlacement((node,), NumaPolicy.PREFERRED),
        "the NUMA node of every GPU on this host (preferred: another node takes what does not fit)",
    )
