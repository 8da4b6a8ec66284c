"""A region the agent hosts survives an engine that, starting, removes every region file no process
holds with a shared flock (the start-up sweep of orphaned /dev/shm region files vLLM has been
offered, PR 54619): the agent holds a shared flock on each of its region's files for as long as
it hosts the region. It lets go when it drains, so removal still waits only for the engines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvshm.api import NodeRegionPhase
from tests.agent.builders import holding, make_reconciler, settle, stop_agent, view
from tests.agent.test_segmented_regions import FILE_0, FILE_1, files, segmented

# What such a sweep does with each file its pattern matches, in a process of its own: removed
# when an exclusive flock is granted at once (no one holds a shared one) and the name still
# names the file it locked.
SWEEP = """
import fcntl, glob, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "vllm_offload_*"))):
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        named, locked = os.stat(path), os.fstat(fd)
        if (named.st_dev, named.st_ino) == (locked.st_dev, locked.st_ino):
            os.unlink(path)
            print("removed", os.path.basename(path))
    except BlockingIOError:
        print("held", os.path.basename(path))
    finally:
        os.close(fd)
"""


def sweep(directory: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", SWEEP, str(directory)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return done.stdout.splitlines()


def test_a_sweep_removes_none_of_a_hosted_regions_files(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    assert settle(reconciler, view(segmented())).reports["ns1/seg"].phase is NodeRegionPhase.READY
    assert sweep(root / "ns1" / "seg") == [f"held {FILE_0}", f"held {FILE_1}"]
    assert files(root) == [FILE_0, FILE_1]
    # and an agent started again adopts the files and holds them as well
    again = make_reconciler(root)
    assert settle(again, view(segmented())).reports["ns1/seg"].phase is NodeRegionPhase.READY
    stop_agent(reconciler)  # the first agent's process is gone
    assert sweep(root / "ns1" / "seg") == [f"held {FILE_0}", f"held {FILE_1}"]
    # the agent's own hold does not delay the removal: drained at once, no engine holding
    removed = settle(again, view(segmented(), deleting=("ns1/seg",))).reports["ns1/seg"]
    assert removed.phase is NodeRegionPhase.REMOVED, removed
    assert "grace period" not in removed.message, removed.message
    assert files(root) == []


def test_what_the_agent_no_longer_hosts_is_not_held(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    settle(reconciler, view(segmented()))
    stop_agent(reconciler)
    assert sweep(root / "ns1" / "seg") == [f"removed {FILE_0}", f"removed {FILE_1}"]


def test_a_file_locked_exclusively_by_another_process_fails_the_attempt_until_let_go(
    shm_dir: Path,
) -> None:
    """A tenant (or a sweep between its lock and its unlink) holding a later file exclusively:
    the agent cannot hold it, so the attempt fails naming the file; once let go, one succeeds."""
    root = shm_dir / "root"
    first = make_reconciler(root)
    settle(first, view(segmented()))
    stop_agent(first)
    with holding(root / "ns1" / "seg" / FILE_1, "exclusive"):
        report = settle(make_reconciler(root), view(segmented())).reports["ns1/seg"]
        assert report.phase is NodeRegionPhase.FAILED, report
        assert f"{FILE_1}" in report.message and "locked exclusively" in report.message
    again = settle(make_reconciler(root), view(segmented())).reports["ns1/seg"]
    assert again.phase is NodeRegionPhase.READY, again
