"""`kvshm-agent mount-root`, the chart's init container, with real mounts: an empty root (or one
holding only a serving pod's empty directories) gets a huge-page tmpfs; a tmpfs of its own is
remounted to the size and huge= asked for and refused without nosuid, nodev, noexec; a root
holding anything else fails loudly with nothing removed; and the mount reaches the host's mount
namespace exactly when the root's mount is shared (Bidirectional propagation), as a pod's would."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvshm.agent.root.rootfs import find_mount
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
    assert again.returncode == 0, again.stderr
    assert "is size=64m,huge=within_size already: region files get 2 MiB pages" in again.stdout
    assert len(mounts_at(empty_root)) == 1


SAFE = "nosuid,nodev,noexec"


def test_a_root_already_the_tmpfs_asked_for_is_left_as_it_is() -> None:
    with mounted_tmpfs(f"size=32m,huge=always,{SAFE}") as root:
        (root / "ns").mkdir()  # regions there: nothing is in the way of leaving it
        done = mount_root(root, "--size=32m", "--huge=always")
        assert done.returncode == 0, done.stderr
        assert "already: region files get 2 MiB pages" in done.stdout
        [options] = mounts_at(root)
        assert {"size=32768k", "huge=always"} <= set(options.split(","))


@pytest.mark.parametrize("size", ["25%", "50%", "3000k"])
def test_a_size_is_compared_as_the_kernel_rounds_it(size: str) -> None:
    """A percentage is of the node's memory in pages, bytes are rounded up to pages, and
    mountinfo leaves out the default (50%): none of these is taken for a change."""
    with mounted_tmpfs(f"size={size},huge=within_size,{SAFE}") as root:
        done = mount_root(root, f"--size={size}")
        assert done.returncode == 0, done.stderr
        assert f"is size={size},huge=within_size already" in done.stdout, done.stdout


def test_a_new_size_is_applied_to_the_mounted_tmpfs_and_its_files_kept() -> None:
    """The agent pod of an upgrade that raised regionRootMount.size finds the old tmpfs: the
    size asked for is applied in place (a 1m tmpfs stayed 1m when 256g was asked)."""
    with mounted_tmpfs(f"size=1m,huge=within_size,mode=0711,{SAFE}") as root:
        (root / "ns").mkdir()
        (root / "ns" / "region").write_bytes(b"kept")
        done = mount_root(root, "--size=64m")
        assert done.returncode == 0, done.stderr
        assert "size=1024k,huge=within_size -> size=65536k,huge=within_size" in done.stdout
        [options] = mounts_at(root)
        assert "size=65536k" in options.split(","), options
        assert (root / "ns" / "region").read_bytes() == b"kept"
        # and back down, while what is on it still fits
        assert mount_root(root, "--size=8m").returncode == 0
        assert "size=8192k" in mounts_at(root)[0].split(",")


def test_a_tmpfs_without_huge_pages_gets_them_by_a_remount_not_a_second_mount() -> None:
    with mounted_tmpfs(f"size=64m,mode=0711,{SAFE}") as root:
        (root / "ns").mkdir()
        done = mount_root(root, "--size=64m")
        assert done.returncode == 0, done.stderr
        assert "huge=never -> size=65536k,huge=within_size" in done.stdout
        assert "region files get 2 MiB pages" in done.stdout
        [options] = mounts_at(root)  # the same tmpfs, its directory still there
        assert "huge=within_size" in options.split(",") and (root / "ns").is_dir()


def test_a_size_smaller_than_what_the_files_take_fails_loudly() -> None:
    with mounted_tmpfs(f"size=32m,huge=within_size,{SAFE}") as root:
        (root / "region").write_bytes(b"x" * (12 << 20))
        done = mount_root(root, "--size=8m")
        assert done.returncode == 1
        assert "cannot remount the region root's tmpfs" in done.stderr
        assert "its files take 12.0 MiB, more than size=8m" in done.stderr, done.stderr
        assert "size=32768k" in mounts_at(root)[0].split(",")
        assert (root / "region").stat().st_size == 12 << 20


@pytest.mark.parametrize("flags", ["nodev,noexec", "nosuid,noexec", "nosuid,nodev", ""])
def test_a_tmpfs_mounted_without_nosuid_nodev_noexec_is_refused(flags: str) -> None:
    missing = [flag for flag in SAFE.split(",") if flag not in flags.split(",")]
    with mounted_tmpfs(",".join(filter(None, ["size=1m,huge=within_size", flags]))) as root:
        done = mount_root(root, "--size=64m")
        assert done.returncode == 1, done.stdout
        assert f"is mounted without {', '.join(missing)}" in done.stderr, done.stderr
        assert "Nothing was changed" in done.stderr
        assert "size=1024k" in mounts_at(root)[0].split(",")


def test_a_serving_pods_empty_directories_are_removed_and_mounted_over(
    small_tmpfs: Path,
) -> None:
    """After a reboot a serving pod may start before the agent pod: its DirectoryOrCreate
    hostPath makes <root>/<namespace>/<name> on the node's /dev/shm, and the root is no longer
    empty. Those empty directories are removed and the tmpfs is mounted."""
    root = small_tmpfs / "kvshm"
    (root / "serving" / "llama").mkdir(parents=True)
    (root / "other").mkdir()
    with unmounting(root):
        done = mount_root(root, "--size=64m")
        assert done.returncode == 0, done.stderr
        assert "region files get 2 MiB pages" in done.stdout
        assert len(mounts_at(root)) == 1
    assert sorted(os.listdir(root)) == []  # gone from the node's /dev/shm too


@pytest.mark.parametrize(
    ("plant", "named"),
    [
        (lambda root: (root / "ns" / "r" / "vllm_offload_x.mmap").write_bytes(b"1"),
         "ns/r/vllm_offload_x.mmap (a file)"),
        (lambda root: (root / "ns" / "link").symlink_to(root.parent / "elsewhere"),
         "ns/link (a symlink)"),
        (lambda root: (root / "ns" / "a" / "b" / "c" / "d").mkdir(parents=True),
         "ns/a/b/c/d/ (deeper than 4 levels)"),
    ],
    ids=["file", "symlink", "too-deep"],
)  # fmt: skip
def test_a_root_holding_anything_else_fails_loudly_and_removes_nothing(
    small_tmpfs: Path, plant: Callable[[Path], object], named: str
) -> None:
    root = small_tmpfs / "kvshm"
    (root / "ns" / "r").mkdir(parents=True)
    (root / "empty").mkdir()
    (small_tmpfs / "elsewhere").mkdir()  # a symlink's empty target is not the root's to remove
    plant(root)
    before = sorted(str(p.relative_to(small_tmpfs)) for p in small_tmpfs.rglob("*"))
    with unmounting(root):
        done = mount_root(root, "--size=64m")
        assert done.returncode == 1, done.stdout
        assert "holds what is not an empty directory" in done.stderr
        assert named in done.stderr, done.stderr
        assert "Nothing was mounted nor removed" in done.stderr
        assert mounts_at(root) == []
    assert sorted(str(p.relative_to(small_tmpfs)) for p in small_tmpfs.rglob("*")) == before


@pytest.mark.parametrize("mode", ["warn", "ignore"])
def test_where_the_agent_may_run_without_huge_pages_a_root_holding_regions_is_a_warning(
    small_tmpfs: Path, mode: str
) -> None:
    """A node that already serves regions on /dev/shm, the mount turned on later: the agent
    keeps serving them with 4 KiB pages (its HugePages condition says so), never crash-loops."""
    root = small_tmpfs / "kvshm"
    (root / "ns" / "r").mkdir(parents=True)
    (root / "ns" / "r" / "vllm_offload_r.mmap").write_bytes(b"kv")
    with unmounting(root):
        done = mount_root(root, "--size=64m", f"--huge-pages={mode}")
        assert done.returncode == 0, done.stderr
        assert done.stderr.startswith("kvshm-agent mount-root: WARNING:"), done.stderr
        assert "ns/" in done.stderr and "runs on the root as it is" in done.stderr
        assert mounts_at(root) == []
    assert (root / "ns" / "r" / "vllm_offload_r.mmap").read_bytes() == b"kv"
    required = mount_root(root, "--size=64m", "--huge-pages=require")
    assert required.returncode == 1 and "WARNING" not in required.stderr


def test_a_mount_below_the_root_is_never_crossed(small_tmpfs: Path) -> None:
    root = small_tmpfs / "kvshm"
    (root / "ns").mkdir(parents=True)
    with mounted_tmpfs("size=1m") as inner:
        subprocess.run(["mount", "--bind", str(inner), str(root / "ns")], check=True)
        try:
            with unmounting(root):
                done = mount_root(root, "--size=64m")
                assert done.returncode == 1 and "ns/ (a mount point)" in done.stderr
        finally:
            subprocess.run(["umount", str(root / "ns")], check=True)
    assert (root / "ns").is_dir()


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
                # the next agent pod's container binds the node's tmpfs itself: a new size is
                # the tmpfs's own, so the node's mount has it too
                again = mount_root(container, "--size=16m", wrap=wrap)
                assert again.returncode == 0 and "-> size=16384k" in again.stdout, again.stderr
                assert "size=16384k" in mounts_at(host_root)[0].split(",")
        os.rmdir(container)
