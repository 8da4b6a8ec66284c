"""Holder detection: kvshm attachers' shared flock, and the /proc scan for everyone else."""

from __future__ import annotations

import os
from pathlib import Path

from kvshm.agent.root.holders import HoldChecker, scan_proc
from kvshm.region import RegionLayout, SharedOffloadRegion
from tests.agent.builders import holding, leasing

SIZE = 4 * 65536
LAYOUT = RegionLayout(4, 65536, 1)


def make_file(directory: Path) -> Path:
    path = directory / "vllm_offload_h.mmap"
    path.write_bytes(b"\0" * SIZE)
    return path


def is_held(checker: HoldChecker, path: Path) -> bool:
    checker.refresh()
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return checker.is_held(fd, path.name, str(path))
    finally:
        os.close(fd)


def test_a_kvshm_attacher_holds_the_file_until_it_detaches(shm_dir: Path) -> None:
    path = make_file(shm_dir)
    checker = HoldChecker()
    assert not is_held(checker, path)
    with SharedOffloadRegion("h", LAYOUT, directory=str(shm_dir), mode="attach"):
        assert is_held(checker, path)
    assert not is_held(checker, path)


def test_a_process_holding_the_flock_is_seen_from_another_process(shm_dir: Path) -> None:
    path = make_file(shm_dir)
    with holding(path, "flock"):
        assert is_held(HoldChecker(), path)
    assert not is_held(HoldChecker(), path)


def test_a_mapping_without_flock_is_seen_only_by_the_proc_scan(shm_dir: Path) -> None:
    path = make_file(shm_dir)
    with holding(path, "map") as holder:
        assert not is_held(HoldChecker(proc_scan=False), path)
        assert is_held(HoldChecker(proc_scan=True), path)
        st = path.stat()
        assert (st.st_dev, st.st_ino) in scan_proc()
        assert holder.poll() is None
    assert not is_held(HoldChecker(proc_scan=True), path)


def test_the_scan_ignores_the_agents_own_mappings(shm_dir: Path) -> None:
    path = make_file(shm_dir)
    with SharedOffloadRegion("h", LAYOUT, directory=str(shm_dir), mode="attach"):
        st = path.stat()
        assert (st.st_dev, st.st_ino) not in scan_proc()


def test_a_read_lease_counts_as_holding_the_file(shm_dir: Path) -> None:
    """The probe opens the file for writing: a lease holder makes that open fail at once
    (EWOULDBLOCK) instead of letting it through."""
    path = make_file(shm_dir)
    with leasing(path) as leaser:
        assert leaser.stdout is not None and leaser.stdout.readline().strip() == "leased"
        assert is_held(HoldChecker(), path)
    assert not is_held(HoldChecker(), path)


COUNT_IN_PID_NAMESPACE = """
import json, os, sys
from kvshm.agent.root.holders import HoldChecker
path, host_table = sys.argv[1], sys.argv[2]
st = os.stat(path)
counts = {}
for name, table in (("own", "/proc/locks"), ("host", host_table)):
    checker = HoldChecker(lock_table=table)
    checker.refresh()
    counts[name] = checker.flock_holders((st.st_dev, st.st_ino))
print(json.dumps({"pid": os.getpid(), **counts}))
"""


def test_holders_in_other_pid_namespaces_are_counted_from_the_hosts_lock_table(
    shm_dir: Path, tmp_path: Path
) -> None:
    """An agent pod without hostPID: its /proc lists only the locks of its own PID namespace,
    so a serving pod's flock is missing there and counted through the host's table (the chart
    mounts /proc/locks read-only), where the agent's own locks carry its host pid."""
    import json
    import subprocess
    import sys

    path = make_file(shm_dir)
    host_table = tmp_path / "locks"
    host_table.touch()
    subprocess.run(["mount", "--bind", "/proc/locks", str(host_table)], check=True)
    try:
        with holding(path, "flock"), holding(path, "flock"):
            done = subprocess.run(
                ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                 COUNT_IN_PID_NAMESPACE, str(path), str(host_table)],
                capture_output=True, text=True, check=False, timeout=60,
            )  # fmt: skip
    finally:
        subprocess.run(["umount", str(host_table)], check=False)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen["pid"] == 1  # the agent in a PID namespace of its own, as in a pod
    assert seen == {"pid": 1, "own": 0, "host": 2}
