"""What bench/agent/hostile.py reads off an agent under attack: a scratch tmpfs and its use, a
process tree's peak memory, how long the agent took to say something."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.agent.hostile import RunningAgent

LIMIT_SECONDS = 60.0


@contextmanager
def tmpfs(size: str) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvshm-bench-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)])
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        os.rmdir(path)


def used_mib(mount: Path) -> float:
    st = os.statvfs(mount)
    return round((st.f_blocks - st.f_bfree) * st.f_frsize / 2**20, 1)


def peak_mib(pid: int) -> float:
    """Peak RSS of a process and its children still alive (the event writer)."""
    total = 0
    for each in [pid, *_children(pid)]:
        try:
            status = Path(f"/proc/{each}/status").read_text()
        except OSError:
            continue
        found = re.search(r"^VmHWM:\s+(\d+)", status, re.M)
        total += int(found.group(1)) if found else 0
    return round(total / 1024, 1)


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def time_to(agent: RunningAgent, text: str, limit: float = LIMIT_SECONDS) -> float | None:
    try:
        return round(agent.saw(text, limit), 2)
    except AssertionError:
        return None
