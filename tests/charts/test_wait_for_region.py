"""The serving pods' init container script (examples/serving/wait-for-region.yaml), run with sh
on real tmpfs files: it lets the pod start only once every file of the region is there at its
size and populated, and otherwise fails saying which file is not."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from kvshm.region import RegionFormat, RegionLayout
from tests.agent_region import agent_made_region
from tests.charts.tools import REPO

SCRIPT = yaml.safe_load((REPO / "examples/serving/wait-for-region.yaml").read_text())["data"][
    "wait-for-region.sh"
]


def _wait(
    directory: Path, rows: int, stride: int, region_format: str, **extra: str
) -> tuple[int, str]:
    env = dict(
        os.environ,
        **extra,
        KVSHM_DIR=str(directory),
        KVSHM_INSTANCE_ID="engine_dp1",
        KVSHM_NUM_BLOCKS=str(rows),
        KVSHM_ROW_STRIDE=str(stride),
        KVSHM_FORMAT=region_format,
        KVSHM_WAIT_SECONDS="0",  # look once, then give up
    )
    done = subprocess.run(
        ["sh", "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    return done.returncode, done.stdout + done.stderr


def test_a_populated_single_file_region_lets_the_pod_start(shm_dir: Path) -> None:
    rows, cell, workers = 64, 12288, 2
    code, out = _wait(shm_dir, rows, cell * workers, "vllm-0.27")
    assert code == 1 and "vllm_offload_engine_dp1.mmap is missing" in out
    layout = RegionLayout(rows, cell, workers, RegionFormat.VLLM_0_27)
    region = agent_made_region(shm_dir, "engine_dp1", layout, populate=False)
    try:
        code, out = _wait(shm_dir, rows, cell * workers, "vllm-0.27")
        assert code == 1 and f"0 of {rows * cell * workers} bytes populated" in out, out
        region.populate()
        code, out = _wait(shm_dir, rows, cell * workers, "vllm-0.27")
        assert code == 0 and "ready: 1 file(s)" in out, out
        code, out = _wait(shm_dir, rows + 1, cell * workers, "vllm-0.27")
        assert code == 1 and f"has {rows * cell * workers} bytes, not" in out, out
    finally:
        region.cleanup()


def test_every_segment_of_a_vllm_033_region_is_waited_for(shm_dir: Path) -> None:
    """A 3 GiB region is 3 files for vLLM 0.33 (sparse here: sized, never populated)."""
    rows, stride = 1000, 800 * 4096  # 3.05 GiB
    layout = RegionLayout(rows, stride, 1, RegionFormat.VLLM_0_33)
    files = [(file.name, file.length) for file in layout.files("engine_dp1")]
    assert [name for name, _ in files] == [
        "vllm_offload_engine_dp1.mmap",
        "vllm_offload_engine_dp1.mmap.1",
        "vllm_offload_engine_dp1.mmap.2",
    ]
    assert [size for _, size in files] == [334 * stride, 334 * stride, 332 * stride]
    for name, size in files:
        fd = os.open(shm_dir / name, os.O_CREAT | os.O_WRONLY, 0o600)
        os.ftruncate(fd, size)
        os.close(fd)
    code, out = _wait(shm_dir, rows, stride, "vllm-0.33")
    # sizes all right, so it went on to population, starting at the first file
    assert code == 1 and f"{files[0][0]}: 0 of {files[0][1]} bytes populated" in out, out
    code, out = _wait(shm_dir, rows, stride, "vllm-0.33", KVSHM_POPULATED="false")
    assert code == 0 and "ready: 3 file(s)" in out, out  # a region kept unpopulated on purpose
    (shm_dir / files[1][0]).unlink()
    code, out = _wait(shm_dir, rows, stride, "vllm-0.33")
    assert code == 1 and f"{files[1][0]} is missing" in out, out
    code, out = _wait(shm_dir, rows, stride, "vllm-0.27")  # one file expected: wrong size
    assert code == 1 and f"has {files[0][1]} bytes, not {rows * stride}" in out, out


def test_a_data_parallel_engines_region_is_linked_into_its_dev_shm_once_ready(
    shm_dir: Path,
) -> None:
    """KVSHM_LINK_DIR (the pod's own /dev/shm) gets a symlink to each region file, only once
    the region is ready, and again over the links a restarted pod's emptyDir kept."""
    rows, stride = 1000, 800 * 4096  # 3 files
    region_dir, dev_shm = shm_dir / "region", shm_dir / "dev-shm"
    region_dir.mkdir()
    dev_shm.mkdir()
    layout = RegionLayout(rows, stride, 1, RegionFormat.VLLM_0_33)
    links = {dev_shm / file.name: region_dir / file.name for file in layout.files("engine_dp1")}
    code, out = _wait(region_dir, rows, stride, "vllm-0.33", KVSHM_LINK_DIR=str(dev_shm))
    assert code == 1 and list(dev_shm.iterdir()) == [], out  # nothing linked before it is there
    region = agent_made_region(region_dir, "engine_dp1", layout, populate=False)
    try:
        for _ in range(2):  # the second time over the links the first one made
            code, out = _wait(
                region_dir, rows, stride, "vllm-0.33",
                KVSHM_LINK_DIR=str(dev_shm), KVSHM_POPULATED="false",
            )  # fmt: skip
            assert code == 0 and f"linked 3 file(s) into {dev_shm}" in out, out
            assert {link: Path(os.readlink(link)) for link in dev_shm.iterdir()} == links
            assert all(link.stat().st_ino == target.stat().st_ino for link, target in links.items())
    finally:
        region.cleanup()
    code, out = _wait(region_dir, rows, stride, "vllm-0.33")
    assert "linked" not in out  # without KVSHM_LINK_DIR: waits only
