"""The node's memory as the kernel counts it: /proc/meminfo, and a pod's memory cgroup (v1,
the cgroupfs driver the node's kubelet runs with)."""

from __future__ import annotations

from pathlib import Path

KUBEPODS = Path("/sys/fs/cgroup/memory/kubepods")


def meminfo_bytes(field: str) -> int:
    """A /proc/meminfo field ("MemTotal", "ShmemHugePages", ...) in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/meminfo")


def pod_memory_cgroup(uid: str) -> Path:
    [found] = KUBEPODS.glob(f"**/pod{uid}")
    return found


def memory_stat(cgroup: Path) -> dict[str, int]:
    """memory.stat of a cgroup: its own counts, and total_* ones with its children's."""
    return {
        name: int(value)
        for name, value in (
            line.split() for line in (cgroup / "memory.stat").read_text().splitlines()
        )
    }
