"""The region root must be a tmpfs: a root on any other filesystem (a hostPath whose tmpfs is not
mounted is a directory on the node's disk) is refused at start-up, naming what it found, and
nothing is made there; the agent's own root is made unlistable by other users."""

from __future__ import annotations

import os
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from kvshm.agent.root.saferoot import RegionRoot
from tests.agent.builders import local_agent, manifest
from tests.agent.cluster import REPO


@pytest.fixture(params=["ext4", "ramfs", "hugetlbfs"])
def other_filesystem(request: pytest.FixtureRequest) -> Iterator[tuple[str, Path]]:
    """(type, mount point) of a real filesystem that is not a tmpfs, mounted 0755 for this test:
    ext4 on an 8 MiB image (the node's disk), ramfs, and hugetlbfs (huge pages, yet not what
    regions are made on)."""
    fs_type: str = request.param
    path = Path(tempfile.mkdtemp(prefix=f"kvshm-{fs_type}-"))
    with tempfile.NamedTemporaryFile(prefix="kvshm-disk-") as image:
        if fs_type == "ext4":
            os.truncate(image.name, 8 * 1024 * 1024)
            subprocess.run(["mkfs.ext4", "-q", "-F", image.name], check=True)
            mount = ["mount", "-o", "loop", image.name, str(path)]
        else:
            mount = ["mount", "-t", fs_type, "-o", "mode=0755", fs_type, str(path)]
        subprocess.run(mount, check=True)
        try:
            yield fs_type, path
        finally:
            subprocess.run(["umount", str(path)], check=False)
            os.rmdir(path)


@pytest.fixture
def regions(shm_dir: Path) -> Path:
    """A directory with one 2 MiB region, default/small: it would fit any of these roots."""
    path = shm_dir / "regions"
    path.mkdir()
    (path / "r.yaml").write_text(yaml.safe_dump(manifest("small", "default")))
    return path


def agent_once(regions: Path, root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        local_agent(regions, root, "--once", "--no-http"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_a_root_on_another_filesystem_is_refused_with_what_to_do(
    other_filesystem: tuple[str, Path], regions: Path
) -> None:
    fs_type, mount = other_filesystem
    root = mount  # the mount point itself, as a hostPath directory the kubelet made
    before = sorted(root.iterdir())
    done = agent_once(regions, root)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{root} is on the {fs_type} filesystem mounted at {mount}, not a tmpfs" in done.stderr
    assert f"Mount a tmpfs at {root}" in done.stderr
    assert "point --root" in done.stderr
    assert sorted(root.iterdir()) == before


def test_a_missing_root_is_not_made_on_another_filesystem(
    other_filesystem: tuple[str, Path], regions: Path
) -> None:
    fs_type, mount = other_filesystem
    root = mount / "kvshm"
    done = agent_once(regions, root)
    assert done.returncode == 2, done.stdout + done.stderr
    assert (
        f"{root} does not exist and {mount}, where it would be made, is on the {fs_type} "
        f"filesystem mounted at {mount}, not a tmpfs" in done.stderr
    )
    assert not root.exists()


def test_a_tmpfs_mounted_at_the_root_is_used_and_made_unlistable(
    small_tmpfs: Path, regions: Path
) -> None:
    # a dedicated tmpfs (docs/deploy.md) mounted 0755, as a mount without mode= leaves it
    assert stat.S_IMODE(small_tmpfs.stat().st_mode) == 0o755
    done = agent_once(regions, small_tmpfs)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "default/small  Ready" in done.stdout
    assert stat.S_IMODE(small_tmpfs.stat().st_mode) == 0o711


def test_a_root_already_stricter_than_unlistable_is_left_as_it_is(shm_dir: Path) -> None:
    root = shm_dir / "private"
    root.mkdir(mode=0o700)
    RegionRoot(str(root)).close()
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
