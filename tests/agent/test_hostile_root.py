"""A region root tenants can write into: planted symlinks, FIFOs, hard links and directories are
refused and reported, never followed, and nothing outside the root changes."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshm.agent.root.saferoot import RegionRoot
from kvshm.api import NodeRegionPhase, ReclaimOutcome
from kvshm.region import UnsafePathError
from tests.agent.builders import make_reconciler, reclaim, region, region_dir, settle, view
from tests.agent.test_segmented_regions import FILE_1, segmented

Snapshot = dict[str, tuple[int, int, int, int, int, bytes]]


@pytest.fixture
def outside(shm_dir: Path) -> Iterator[Path]:
    """A directory beside the root (same tmpfs, so hard links work) that must never change."""
    path = shm_dir / "outside"
    path.mkdir(mode=0o755)
    (path / "secret").write_bytes(b"not a region")
    os.chmod(path / "secret", 0o644)
    (path / "vllm_offload_r1.mmap").write_bytes(b"")
    yield path


def snapshot(directory: Path) -> Snapshot:
    state = {}
    for entry in sorted(directory.iterdir()):
        st = entry.lstat()
        data = entry.read_bytes() if stat.S_ISREG(st.st_mode) else b""
        state[entry.name] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_nlink, data)
    st = directory.lstat()
    state["."] = (st.st_mode, st.st_uid, st.st_gid, 0, 0, b"")
    return state


def failed_message(root: Path, **spec: object) -> str:
    result = settle(make_reconciler(root), view(region(**spec)))  # type: ignore[arg-type]
    report = result.reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.FAILED, report
    return report.message


@pytest.mark.parametrize("target", ["secret", "vllm_offload_r1.mmap"])
def test_symlink_at_the_region_file_is_refused(shm_dir: Path, outside: Path, target: str) -> None:
    root = shm_dir / "root"
    before = snapshot(outside)
    (region_dir(root) / "vllm_offload_r1.mmap").symlink_to(outside / target)
    assert "symbolic link" in failed_message(root, access={"uid": 4321, "gid": 4321})
    assert snapshot(outside) == before


def test_fifo_at_the_region_file_is_refused_without_blocking(shm_dir: Path) -> None:
    root = shm_dir / "root"
    os.mkfifo(region_dir(root) / "vllm_offload_r1.mmap")
    assert "FIFO" in failed_message(root)


def test_hard_link_at_the_region_file_is_refused(shm_dir: Path, outside: Path) -> None:
    root = shm_dir / "root"
    size = 16 * 65536 * 2
    os.truncate(outside / "secret", size)  # even of the right size
    before = snapshot(outside)
    os.link(outside / "secret", region_dir(root) / "vllm_offload_r1.mmap")
    message = failed_message(root, access={"uid": 4321, "gid": 4321, "mode": 0o600})
    assert "2 hard links" in message
    after = snapshot(outside)
    assert after["secret"][:4] == before["secret"][:4]  # mode, owner, size untouched
    assert after["secret"][5] == before["secret"][5]


def test_directory_at_the_region_file_is_refused(shm_dir: Path) -> None:
    root = shm_dir / "root"
    (region_dir(root) / "vllm_offload_r1.mmap").mkdir()
    assert "a directory" in failed_message(root)


@pytest.mark.parametrize("level", ["namespace", "region"])
def test_symlink_at_a_directory_is_refused(shm_dir: Path, outside: Path, level: str) -> None:
    root = shm_dir / "root"
    root.mkdir(mode=0o711)
    before = snapshot(outside)
    if level == "namespace":
        (root / "ns1").symlink_to(outside)
    else:
        (root / "ns1").mkdir(mode=0o711)
        (root / "ns1" / "r1").symlink_to(outside)
    message = failed_message(root, access={"uid": 4321, "gid": 4321})
    assert "symbolic link" in message
    assert snapshot(outside) == before


@pytest.mark.parametrize("kind", ["file", "fifo"])
def test_non_directory_where_a_directory_goes_is_refused(shm_dir: Path, kind: str) -> None:
    root = shm_dir / "root"
    root.mkdir(mode=0o711)
    (root / "ns1").mkdir(mode=0o711)
    planted = root / "ns1" / "r1"
    if kind == "file":
        planted.write_bytes(b"")
    else:
        os.mkfifo(planted)
    message = failed_message(root)
    assert ("a regular file" if kind == "file" else "a FIFO") in message


def test_namespace_directory_someone_else_owns_is_refused(shm_dir: Path) -> None:
    root = shm_dir / "root"
    root.mkdir(mode=0o711)
    (root / "ns1").mkdir(mode=0o777)
    os.chmod(root / "ns1", 0o777)
    assert "mode 0o777" in failed_message(root)


def test_a_root_that_is_a_symlink_or_not_the_agents_is_refused(
    shm_dir: Path, outside: Path
) -> None:
    (shm_dir / "link").symlink_to(outside)
    with pytest.raises(UnsafePathError, match="symbolic link"):
        RegionRoot(str(shm_dir / "link"))
    shared = shm_dir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafePathError, match="no one else can write"):
        RegionRoot(str(shared))
    foreign = shm_dir / "foreign"
    foreign.mkdir(mode=0o711)
    os.chown(foreign, 4321, 4321)
    with pytest.raises(UnsafePathError, match="owned by uid 4321"):
        RegionRoot(str(foreign))


def test_invalid_names_never_become_paths(shm_dir: Path) -> None:
    root = RegionRoot(str(shm_dir / "root"))
    cases = [("..", "r1"), ("ns1", ".."), ("ns1", "a/b"), ("NS", "r1")]
    # names the API server refuses are refused too, not only unsafe ones: one rule everywhere
    cases += [("ns1", "a..b"), ("ns1", "a.-b"), ("ns.1", "r1"), ("n" * 64, "r1")]
    for namespace, name in cases:
        with pytest.raises(UnsafePathError):
            root.open_region_dir(namespace, name)
    assert list((shm_dir / "root").iterdir()) == []


def test_a_symlink_planted_over_a_ready_region_is_not_followed_on_drain(
    shm_dir: Path, outside: Path
) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    settle(reconciler, view(region()))
    before = snapshot(outside)
    path = root / "ns1" / "r1" / "vllm_offload_r1.mmap"
    path.unlink()
    path.symlink_to(outside / "secret")
    result = settle(reconciler, view())
    report = result.reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.REMOVED
    assert "symbolic link" in report.message
    assert path.is_symlink()  # left in place, reported
    assert snapshot(outside) == before


@pytest.mark.parametrize("which", ["file 0", "a later file"])
def test_a_ready_regions_file_replaced_by_a_symlink_fails_the_region_naming_it(
    shm_dir: Path, outside: Path, which: str
) -> None:
    """A tenant may replace a file of its region by a symlink while the region is still wanted
    (vLLM in its pod would open the link): the region is Failed and the inventory names the
    link, which is left in place and never followed."""
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    wanted, file_name = (
        (region(), "vllm_offload_r1.mmap") if which == "file 0" else (segmented(), FILE_1)
    )
    assert settle(reconciler, view(wanted)).reports[wanted.key].phase is NodeRegionPhase.READY
    before = snapshot(outside)
    path = root / wanted.key / file_name
    path.unlink()
    path.symlink_to(outside / "secret")
    result = settle(reconciler, view(wanted))
    report = result.reports[wanted.key]
    assert report.phase is NodeRegionPhase.FAILED, report
    assert f"{path} is a symbolic link, not a region file" in report.message
    assert result.root_scan is not None
    assert any(f"{path} is a symbolic link" in problem for problem in result.root_scan.problems)
    assert path.is_symlink() and snapshot(outside) == before


def test_inventory_reports_unsafe_entries_without_opening_them(
    shm_dir: Path, outside: Path
) -> None:
    root = shm_dir / "root"
    directory = region_dir(root)
    (directory / "vllm_offload_a.mmap").symlink_to(outside / "secret")
    os.mkfifo(directory / "vllm_offload_b.mmap")
    (root / "ns1" / "elsewhere").symlink_to(outside)
    (root / "ns1" / "no..region").mkdir()  # a name no OffloadRegion can have
    result = make_reconciler(root).reconcile(view())
    assert result.root_scan is not None
    assert result.root_scan.inventory.files == ()
    problems = "\n".join(result.root_scan.problems)
    assert "vllm_offload_a.mmap is a symbolic link" in problems
    assert "vllm_offload_b.mmap is a FIFO" in problems
    assert "elsewhere is a symbolic link" in problems
    assert "no..region: not a region directory name; ignored" in problems


@pytest.mark.parametrize(
    "path",
    [
        "../outside/vllm_offload_r1.mmap",
        "ns1/../../outside/vllm_offload_r1.mmap",
        "/etc/passwd",
        "ns1/r1/secret",
        "ns1/r1",
    ],
)
def test_reclaim_paths_that_leave_the_root_are_refused(
    shm_dir: Path, outside: Path, path: str
) -> None:
    root = shm_dir / "root"
    before = snapshot(outside)
    reconciler = make_reconciler(root)
    result = reconciler.reconcile(view(reclaims=(reclaim(path),)))
    assert result.reclaims[path].outcome is ReclaimOutcome.FAILED
    assert "nothing was removed" in result.reclaims[path].message
    assert snapshot(outside) == before


def test_reclaim_of_a_symlink_removes_nothing(shm_dir: Path, outside: Path) -> None:
    root = shm_dir / "root"
    (region_dir(root) / "vllm_offload_r1.mmap").symlink_to(outside / "vllm_offload_r1.mmap")
    before = snapshot(outside)
    path = "ns1/r1/vllm_offload_r1.mmap"
    result = make_reconciler(root).reconcile(view(reclaims=(reclaim(path),)))
    assert result.reclaims[path].outcome is ReclaimOutcome.FAILED
    assert "symbolic link" in result.reclaims[path].message
    assert snapshot(outside) == before


def test_a_region_directory_the_kubelet_made_first_is_adopted_with_the_regions_owner(
    shm_dir: Path,
) -> None:
    """A serving pod created before its region mounts the directory with hostPath
    DirectoryOrCreate: the kubelet makes it (and the namespace's) as root, 0755. The agent
    keeps that directory (the pod's mount is of it), gives it the region's owner and mode, and
    takes the listing bits off the namespace directory as it does for the ones it makes."""
    root = shm_dir / "root"
    made = root / "ns1" / "r1"
    made.mkdir(parents=True, mode=0o755)
    for each in (root, root / "ns1", made):
        os.chmod(each, 0o755)
    inode = made.stat().st_ino
    result = settle(make_reconciler(root), view(region(access={"uid": 1000, "gid": 1000})))
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.READY, result.reports
    st = made.stat()
    assert (st.st_ino, st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (inode, 1000, 1000, 0o700)
    assert stat.S_IMODE((root / "ns1").stat().st_mode) == 0o711
    assert [p.name for p in made.iterdir() if p.name.startswith("vllm_offload_")] == [
        "vllm_offload_r1.mmap"
    ]
