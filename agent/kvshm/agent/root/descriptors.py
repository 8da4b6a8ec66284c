"""File descriptors: as many as the node allows, and never so few that a pass cannot run.

Each hosted region keeps a few descriptors open in the agent (its file, its directory for the
event writer) and as many in the event-writer child. At the limit, every pass failed (it opens
directories and probes files) and nothing recovered: no region ever reported Ready. So the
agent raises its soft RLIMIT_NOFILE to the hard limit at start, and admits a new region only
while the descriptors it would take leave RESERVE (or a quarter of the limit, if less) free for
the passes, the HTTP endpoint (at most 64 connections) and populating; a region refused for lack
of descriptors is Failed with reason `descriptors` (an Event,
`errors_total{reason="descriptors"}`) and retried every pass.
"""

from __future__ import annotations

import os
import resource

PER_REGION = 8  # measured: 3-4 in the agent per hosted region; the rest is margin
PER_EXTRA_FILE = 1  # a region of several files keeps each further file open in the agent
RESERVE = 192  # 64 HTTP connections, a pass's walk and probes, populate threads, the child's pipe


def raise_soft_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (bounded by fs.nr_open); (old, new)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open", encoding="ascii") as nr_open:
                target = int(nr_open.read())
        except (OSError, ValueError):
            return soft, soft
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError):
            return soft, soft
        return soft, target
    return soft, soft


def open_descriptors() -> int:
    """How many descriptors this process has open."""
    return len(os.listdir("/proc/self/fd")) - 1  # not the one listing them


class DescriptorBudget:
    """Whether one more region fits in this process's descriptor limit, with RESERVE left."""

    def __init__(
        self,
        per_region: int = PER_REGION,
        reserve: int = RESERVE,
        per_extra_file: int = PER_EXTRA_FILE,
    ) -> None:
        self.per_region = per_region
        self.reserve = reserve
        self.per_extra_file = per_extra_file

    def needed(self, files: int = 1) -> int:
        """Descriptors a region of `files` files takes."""
        return self.per_region + self.per_extra_file * max(0, files - 1)

    def refusal(self, files: int = 1) -> str | None:
        """None if a region of `files` files may be opened; else why not and what to do."""
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        reserve = min(self.reserve, limit // 4)  # a small limit still hosts some regions
        used = open_descriptors()
        needed = self.needed(files)
        if used + needed + reserve <= limit:
            return None
        return (
            f"not enough file descriptors: the agent has {used} open of its limit of {limit} "
            f"and keeps {reserve} free for its passes and endpoint, and this region takes "
            f"about {needed}; retried every pass. Raise the agent's RLIMIT_NOFILE "
            f"(hard limit: the agent raises its soft limit to it at start), or host fewer "
            f"regions on this node"
        )
