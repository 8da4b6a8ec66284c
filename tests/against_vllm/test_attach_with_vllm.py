"""vLLM's own SharedOffloadRegion attaches a region kvshm created: one process per rank, each in
its own mount namespace whose /dev/shm shows the region as a serving pod sees it (the region's
directory, or a tmpfs of the pod's own with symlinks to the region's files), called exactly as
that release's CPUOffloadingSpec.create_worker calls it. Every (rank, block, tensor) slice vLLM
writes is what kvshm reads, and the reverse; vLLM maps the agent's files (their inodes) as a
joiner and never removes a file or a link.

Single-file regions with page-aligned rows, below 2 GiB, in the format of the release attaching
them (vllm-0.33 for vLLM 0.33.0, vllm-0.27 for 0.32.0, the last single-file release), and MLA's
replicated layout; test_attach_segmented.py attaches segmented, padded ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
import yaml

from kvshm.region import RegionFormat, RegionLayout
from tests.against_vllm.patterns import pattern
from tests.against_vllm.vllm_code import HERE, vllm_env
from tests.agent_region import agent_made_region, attach_as_worker

TENSORS = 4  # canonical tensors per worker cell (e.g. K and V of two layers)
TENSOR_PAGE = 3 * 1024  # bytes of one tensor in one chunk
NUM_BLOCKS = 40
ENGINE_ID = "llama-kv"
# the region format each vLLM release expects
FORMATS = {"0.33.0": RegionFormat.VLLM_0_33, "0.32.0": RegionFormat.VLLM_0_27}


# the serving pods' init container script, which links a data-parallel engine's region files
WAIT_SCRIPT = yaml.safe_load(
    (HERE.parents[1] / "examples/serving/wait-for-region.yaml").read_text()
)["data"]["wait-for-region.sh"]

# How the serving pod sees the region (examples/serving): its directory as /dev/shm, or (data
# parallelism) a tmpfs /dev/shm (the pod's emptyDir) with the region's directory mounted at
# /dev/shm/kvshm/<region name> and its files linked into /dev/shm by the init container's script
MOUNT_SHM = {
    "directory": 'mount --bind "$0" /dev/shm',
    "links": 'stage=$(mktemp -d) && mount -t tmpfs -o size=16m tmpfs "$stage" && '
    'mkdir -p "$stage/kvshm/${0##*/}" && mount --bind "$0" "$stage/kvshm/${0##*/}" && '
    'mount --move "$stage" /dev/shm && KVSHM_DIR="/dev/shm/kvshm/${0##*/}" '
    'KVSHM_LINK_DIR=/dev/shm sh -c "$KVSHM_WAIT_SCRIPT" >&2',
}


def vllm_report(
    release: str, shm: str, layout: RegionLayout, region_dir: Path, instance_id: str
) -> dict[str, object]:
    """What each vLLM worker must print: it joined, read nothing wrong, mapped exactly the
    agent's files, and left the links (where it attached through them) in place."""
    files = [region_dir / file.name for file in layout.files(instance_id)]
    return {
        "version": release,
        "creator": False,
        "wrong": [],
        "mapped": sorted(path.stat().st_ino for path in files),
        "links": sorted(path.name for path in files) if shm == "links" else [],
    }


def _worker(
    release: str, shm: str, region_dir: Path, job: dict[str, object]
) -> subprocess.Popen[str]:
    """`unshare --mount`: a private mount namespace whose /dev/shm shows the region."""
    region = {  # what the init container's script is told of the region
        "KVSHM_WAIT_SCRIPT": WAIT_SCRIPT,
        "KVSHM_INSTANCE_ID": str(job["engine_id"]),
        "KVSHM_NUM_BLOCKS": str(job["num_chunks"]),
        "KVSHM_ROW_STRIDE": str(job["kv_bytes_per_chunk"]),
        "KVSHM_FORMAT": FORMATS[release].value,
        "KVSHM_POPULATED": "false",  # sizes only: some regions here are sparse
        "KVSHM_WAIT_SECONDS": "0",  # made before the workers start
    }
    return subprocess.Popen(
        [
            "unshare", "--mount", "--propagation", "private", "sh", "-c",
            f'{MOUNT_SHM[shm]} && exec "$@"',
            str(region_dir), sys.executable, str(HERE / "attach_worker.py"), json.dumps(job),
        ],
        # mktemp's stage: the test's
        env={**vllm_env(release), **region, "TMPDIR": str(job["sync_dir"])},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip


@contextmanager
def _kvshm_views(
    region_dir: Path, engine_id: str, rank: int, world: int, region_format: RegionFormat,
    replicated: bool,
) -> Iterator[list[object]]:  # fmt: skip
    layout = RegionLayout(
        NUM_BLOCKS, TENSORS * TENSOR_PAGE, world, region_format, replicated=replicated
    )
    region = attach_as_worker(region_dir, engine_id, layout, rank)
    try:
        yield [region.create_next_view(TENSOR_PAGE) for _ in range(TENSORS)]
    finally:
        region.cleanup()


def _wait_for_files(paths: list[Path], workers: list[subprocess.Popen[str]]) -> None:
    deadline = time.monotonic() + 300
    while not all(path.exists() for path in paths):
        for worker in workers:
            if worker.poll() is not None:
                raise AssertionError(f"a vLLM worker exited early: {worker.communicate()}")
        assert time.monotonic() < deadline, "vLLM workers did not write in time"
        time.sleep(0.05)


def _exchange(
    release: str, shm: str, region_dir: Path, engine_id: str, world: int, sync_dir: Path,
    *, replicated: bool = False,
) -> None:  # fmt: skip
    """kvshm makes the region, vLLM's workers attach and write, kvshm reads and writes back,
    the workers read; then the file is checked to be kvshm's, untouched, and alone."""
    cell = TENSORS * TENSOR_PAGE
    cells = 1 if replicated else world  # MLA: one copy of the latent per row, for every worker
    assert cell * cells % 4096 == 0  # page-aligned rows: vLLM's padded stride is the same
    region_format = FORMATS[release]
    with ExitStack() as stack:
        layout = RegionLayout(NUM_BLOCKS, cell, world, region_format, replicated=replicated)
        creator = agent_made_region(region_dir, engine_id, layout, populate=True)
        assert creator.layout.row_stride == cell * cells
        stack.callback(creator.cleanup)
        region_file = region_dir / f"vllm_offload_{engine_id}.mmap"
        inode = region_file.stat().st_ino
        job = {
            "engine_id": engine_id,
            "num_chunks": NUM_BLOCKS,
            "kv_bytes_per_chunk": cell * cells,
            "cpu_page_size": cell,
            "world": world,
            "tensors": TENSORS,
            "tensor_page": TENSOR_PAGE,
            "sync_dir": str(sync_dir),
            "replicated": replicated,
        }
        workers = [
            _worker(release, shm, region_dir, {**job, "rank": rank}) for rank in range(world)
        ]
        for worker in workers:
            stack.callback(worker.kill)
        _wait_for_files([sync_dir / f"written.{rank}" for rank in range(world)], workers)

        for slot in range(cells):  # replicated: rank 0's cell is every worker's
            with _kvshm_views(
                region_dir, engine_id, slot, world, region_format, replicated
            ) as views:
                for tensor, view in enumerate(views):
                    for block in range(NUM_BLOCKS):
                        expected = pattern("vllm", slot, block, tensor, TENSOR_PAGE)
                        assert view[block].equal(expected), (slot, block, tensor)  # type: ignore[index]
                        view[block].copy_(pattern("kvshm", slot, block, tensor, TENSOR_PAGE))  # type: ignore[index]
        (sync_dir / "kvshm-wrote").touch()

        reports = []
        for worker in workers:
            out, err = worker.communicate(timeout=300)
            assert worker.returncode == 0, err[-4000:]
            reports.append(json.loads(out.strip().splitlines()[-1]))
        assert reports == [vllm_report(release, shm, layout, region_dir, engine_id)] * world
        # vLLM attached as a joiner: the file is kvshm's, still there, and the only one
        assert os.listdir(region_dir) == [region_file.name]
        assert region_file.stat().st_ino == inode


@pytest.mark.parametrize(
    ("release", "world", "shm", "engine_id"),
    [
        ("0.33.0", 1, "directory", ENGINE_ID),
        ("0.33.0", 2, "directory", ENGINE_ID),
        ("0.33.0", 4, "directory", ENGINE_ID),
        ("0.33.0", 2, "links", f"{ENGINE_ID}_dp1"),  # a data-parallel engine's region
        ("0.32.0", 2, "directory", ENGINE_ID),
    ],
)
def test_vllm_attaches_a_kvshm_region_and_both_see_every_byte(
    shm_dir: Path, tmp_path: Path, release: str, world: int, shm: str, engine_id: str
) -> None:
    region_dir = shm_dir / "serving" / engine_id.replace("_", "-")
    region_dir.mkdir(parents=True)
    _exchange(release, shm, region_dir, engine_id, world, tmp_path)


@pytest.mark.parametrize(("release", "world"), [("0.33.0", 2), ("0.33.0", 4), ("0.32.0", 2)])
def test_vllm_attaches_a_replicated_mla_region(
    shm_dir: Path, tmp_path: Path, release: str, world: int
) -> None:
    """MLA at TP > 1: every vLLM worker maps the one copy (rank 0's cell, each pre-faulting its
    share on 0.33); kvshm makes the region with its replicated layout for `world` workers."""
    region_dir = shm_dir / "serving" / "mla-kv"
    region_dir.mkdir(parents=True)
    _exchange(release, "directory", region_dir, "mla-kv", world, tmp_path, replicated=True)
