"""Where a region's pages live on a host of several NUMA nodes: a memory policy set on the
mapping before it is populated, and the kernel's own account of where they went (numa_maps).

mbind, not set_mempolicy: on a tmpfs file mbind sets the file's own shared policy for the
range, so every page of it allocated later, by any process that maps it (the agent's populate
threads, an engine storing into a sparse region), follows it; set_mempolicy would bind only the
calling thread's allocations.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

from kvshm.region.errors import RegionError

NODE_ONLINE = "/sys/devices/system/node/online"
_SYS_MBIND = {"x86_64": 237, "aarch64": 235, "ppc64le": 259, "s390x": 268, "riscv64": 235}
_WORD_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long


class NumaPolicy(IntEnum):
    """The kernel's memory policy modes (linux/mempolicy.h) kvshm uses."""

    PREFERRED = 1  # the first node with room, else any
    BIND = 2  # only these nodes: a full node fails the allocation
    INTERLEAVE = 3  # page by page over these nodes, by offset in the file


@dataclass(frozen=True)
class NumaPlacement:
    """Where a region's pages go: `policy` over `nodes`."""

    nodes: tuple[int, ...]
    policy: NumaPolicy = NumaPolicy.BIND

    def describe(self) -> str:
        nodes = ",".join(map(str, self.nodes))
        return f"NUMA node{'s' if len(self.nodes) > 1 else ''} {nodes} ({self.policy.name.lower()})"


class NumaError(RegionError, OSError):
    """The policy could not be set; the message says which nodes and why."""


def parse_node_list(text: str) -> tuple[int, ...]:
    """A kernel node list ("0", "0-1,4") as the sorted node numbers."""
    nodes: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        nodes.update(range(int(first), int(last or first) + 1))
    return tuple(sorted(nodes))


def online_nodes(path: str = NODE_ONLINE) -> tuple[int, ...]:
    """The host's online NUMA nodes; (0,) where the kernel has no NUMA support."""
    try:
        with open(path, encoding="ascii") as online:
            return parse_node_list(online.read()) or (0,)
    except (OSError, ValueError):
        return (0,)


def set_policy(address: int, length: int, nodes: Sequence[int], policy: NumaPolicy) -> None:
    """mbind [address, address+length) (page-aligned) to `nodes` with `policy`: pages of the
    mapped file allocated from now on follow it; pages already there stay where they are."""
    if not nodes:
        raise NumaError(22, "a NUMA policy needs at least one node")
    number = _SYS_MBIND.get(platform.machine())
    if number is None:
        raise NumaError(38, f"mbind is not wired for {platform.machine()} in kvshm")
    words = max(nodes) // _WORD_BITS + 1
    mask = (ctypes.c_ulong * words)()
    for node in nodes:
        mask[node // _WORD_BITS] |= 1 << (node % _WORD_BITS)
    # the kernel reads maxnode - 1 bits of the mask
    result = _libc.syscall(
        ctypes.c_long(number),
        ctypes.c_void_p(address),
        ctypes.c_ulong(length),
        ctypes.c_int(int(policy)),
        mask,
        ctypes.c_ulong(words * _WORD_BITS + 1),
        ctypes.c_uint(0),
    )
    if result != 0:
        err = ctypes.get_errno()
        raise NumaError(
            err,
            f"mbind of {length} bytes to NUMA node(s) {','.join(map(str, nodes))} "
            f"({policy.name.lower()}) failed: {os.strerror(err)}",
        )


@dataclass(frozen=True)
class NumaMapping:
    """One mapping's line of /proc/<pid>/numa_maps: its policy and pages per node."""

    address: int
    policy: str  # "default", "bind:0", "interleave:0-1", "prefer:1", ...
    file: str = ""
    pages: dict[int, int] = field(default_factory=dict)  # node -> pages of page_bytes
    page_bytes: int = 4096

    def bytes_on(self) -> dict[int, int]:
        return {node: count * self.page_bytes for node, count in self.pages.items()}


_NODE_PAGES = re.compile(r"N(\d+)=(\d+)")


def numa_maps(pid: str = "self") -> list[NumaMapping]:
    """Every mapping of the process, as /proc/<pid>/numa_maps says."""
    mappings = []
    with open(f"/proc/{pid}/numa_maps", encoding="utf-8", errors="replace") as lines:
        for line in lines:
            fields = line.split()
            if len(fields) < 2:
                continue
            pages = {int(m.group(1)): int(m.group(2)) for m in _NODE_PAGES.finditer(line)}
            kernel_kb = next((f for f in fields if f.startswith("kernelpagesize_kB=")), "=4")
            file = next((f[len("file=") :] for f in fields if f.startswith("file=")), "")
            mappings.append(
                NumaMapping(
                    int(fields[0], 16),
                    fields[1],
                    file,
                    pages,
                    int(kernel_kb.partition("=")[2]) * 1024,
                )
            )
    return mappings


def placement(address: int, length: int, pid: str = "self") -> tuple[set[str], dict[int, int]]:
    """(the policies, bytes per node) of the process's mappings that start within
    [address, address+length): where a region's pages are, as the kernel counts them."""
    policies: set[str] = set()
    on_node: dict[int, int] = {}
    for mapping in numa_maps(pid):
        if address <= mapping.address < address + length:
            policies.add(mapping.policy)
            for node, size in mapping.bytes_on().items():
                on_node[node] = on_node.get(node, 0) + size
    return policies, on_node
