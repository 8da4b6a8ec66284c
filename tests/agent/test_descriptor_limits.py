"""Descriptor exhaustion: the agent raises its soft limit at start, and at
its limit it refuses new regions with a reason instead of failing every pass."""

from __future__ import annotations

import re
import resource
import urllib.request
from pathlib import Path
from typing import Any

from tests.agent.hostile import RunningAgent, tenant_manifest, write_regions
from tests.waiting import wait_for

TINY: dict[str, Any] = {"blocks": 4, "page": 4096, "workers": 1}


def _soft_nofile(pid: int) -> int:
    limits = Path(f"/proc/{pid}/limits").read_text()
    found = re.search(r"^Max open files\s+(\d+)", limits, re.MULTILINE)
    assert found is not None
    return int(found.group(1))


def test_the_soft_limit_is_raised_to_the_hard_limit_at_start(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    hard = min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])

    def low_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    agent = RunningAgent(regions, shm_dir / "root", "--no-http", preexec=low_soft_limit)
    with agent:
        wait_for(lambda: _soft_nofile(agent.pid) == hard, 20, "the raised soft limit")


def test_at_the_descriptor_limit_regions_are_refused_and_passes_go_on(shm_dir: Path) -> None:
    regions = shm_dir / "regions"
    regions.mkdir()
    count = 60
    for i in range(count):
        write_regions(regions, f"r{i:02}.yaml", tenant_manifest(f"r{i:02}", **TINY))
    with RunningAgent(regions, shm_dir / "root", "--port", "0", nofile=300) as agent:
        agent.saw("not enough file descriptors", timeout=60)

        def settled() -> tuple[int, int] | None:
            text = agent.output()
            ready = len(set(re.findall(r"tenant/(r\d\d)  Ready", text)))
            refused = len(set(re.findall(r"tenant/(r\d\d)  Failed  not enough file", text)))
            return (ready, refused) if ready + refused == count else None

        ready, refused = wait_for(settled, 60, "every region Ready or refused")
        assert ready >= 10 and refused >= 1
        assert agent.descriptors() < 300
        with urllib.request.urlopen(agent.url + "/healthz", timeout=5) as reply:
            assert reply.status == 200
        # room made: the refused regions are retried and go Ready
        ready_names = sorted(set(re.findall(r"tenant/(r\d\d)  Ready", agent.output())))
        for name in ready_names[: refused + 2]:
            (regions / f"{name}.yaml").unlink()
        last_refused = sorted(
            set(re.findall(r"tenant/(r\d\d)  Failed  not enough file", agent.output()))
        )[-1]
        agent.saw(f"tenant/{last_refused}  Ready", timeout=60)
    assert "Traceback" not in agent.output()
