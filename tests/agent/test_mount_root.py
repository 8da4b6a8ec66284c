"""`kvshm-agent mount-root`, the chart's init container, with real mounts: an empty root gets a
huge-page tmpfs, a root already so or holding files is left alone, and the mount reaches the
host's mount namespace exactly when the root's mount is shared (Bidirectional propagation), as
a pod's would."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshm.agent.rootfs import find_mount
from tests.agent.cluster import REPO
from tests.conftest import mounted_tmpfs


def mount_root(
    root: Path, *extra: str, wrap: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvshm.agent.cli", "mount-root", f"--root={root}", *extra]
    return subprocess.run([*wrap, *command], capture_output=True, text=True, timeout=120, cwd=REPO)


def mounts_at(path: Path) -> list[str]:
    """The super options of every mount at `path`, in the test's own mount namespace."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as lines:
        for line in lines:
            fields, _, rest = line.partition(" - ")
            if fields.split()[4] == str(path):
                found.append(rest.split()[2])
    return found


@contextlib.contextmanager
def unmounting(path: Path) -> Iterator[Path]:
    try:
        yield path
    finally:
        while mounts_at(path):
            subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def empty_root(tmp_path: Path) -> Iterator[Path]:
    with unmounting(tmp_path / "kvshm") as root:
        yield root


def test_an_empty_root_gets_a_huge_page_tmpfs(empty_root: Path) -> None:
    done = mount_root(empty_root, "--size=64m")
    assert done.returncode == 0, done.stderr
    assert "region files get 2 MiB pages (huge=within_size)" in done.stdout
    [options] = mounts_at(empty_root)
    assert {"size=65536k", "huge=within_size", "mode=711"} <= set(options.split(","))
    fd = os.open(empty_root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        mount = find_mount(fd, str(empty_root))
    finally:
        os.close(fd)
    assert mount is not None and mount.fs_type == "tmpfs"
    with open("/proc/self/mountinfo", encoding="utf-8") as lines:
        line = next(each for each in lines if f" {empty_root} " in each)
    assert {"nosuid", "nodev", "noexec"} <= set(line.split()[5].split(","))
    # the next start of the agent pod finds it so and mounts nothing more
    again = mount_root(empty_root, "--size=64m")
    assert again.returncode == 0 and "already gives region files 2 MiB pages" in again.stdout
    assert len(mounts_at(empty_root)) == 1


def test_a_root_holding_files_is_never_mounted_over(small_tmpfs: Path) -> None:
    root = small_tmpfs / "kvshm"
    (root / "ns").mkdir(parents=True)
    with unmounting(root):
        done = mount_root(root, "--size=64m")
        assert done.returncode == 0, done.stderr
        assert "is no tmpfs with huge pages but holds 1 entry (ns)" in done.stderr
        assert "a tmpfs mounted over it would hide them" in done.stderr
        assert mounts_at(root) == [] and (root / "ns").is_dir()


def test_a_root_already_on_a_huge_page_tmpfs_is_left_as_it_is() -> None:
    with mounted_tmpfs("size=32m,huge=always") as root:
        (root / "ns").mkdir()  # regions there: nothing is in the way of leaving it
        done = mount_root(root, "--size=64m")
        assert done.returncode == 0 and "already gives region files 2 MiB pages" in done.stdout
        assert len(mounts_at(root)) == 1


@pytest.mark.parametrize("size", ["64Gi", "0", "101%", "lots"])
def test_a_size_tmpfs_cannot_take_is_refused(empty_root: Path, size: str) -> None:
    done = mount_root(empty_root, f"--size={size}")
    assert done.returncode == 2 and "is not a tmpfs size" in done.stderr
    assert mounts_at(empty_root) == []


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_the_mount_reaches_the_host_only_through_a_shared_mount(shared: bool) -> None:
    """What the kubelet does for Bidirectional: the hostPath bound into the container's own
    mount namespace, rshared. The tmpfs mounted there appears at the host's path when the
    host's mount holding the root is shared (systemd makes every mount so); on a private one
    (this machine's /dev/shm) it stays in the container and is gone with it."""
    with mounted_tmpfs("size=16m") as host_shm:
        subprocess.run(
            ["mount", f"--make-{'shared' if shared else 'private'}", str(host_shm)], check=True
        )
        host_root = host_shm / "kvshm"
        host_root.mkdir()
        container = Path(tempfile.mkdtemp(prefix="kvshm-container-"))
        script = (
            f'mount --bind {host_root} {container} && mount --make-rshared {container} && exec "$@"'
        )
        wrap = ("unshare", "--mount", "--propagation", "unchanged", "sh", "-c", script, "sh")
        with unmounting(host_root):
            done = mount_root(container, "--size=8m", wrap=wrap)
            assert done.returncode == 0, done.stderr
            assert "region files get 2 MiB pages" in done.stdout
            reached = mounts_at(host_root)
            assert bool(reached) == shared, reached
            if shared:
                assert "huge=within_size" in reached[0]
        os.rmdir(container)
