"""One tensor-parallel worker as vLLM runs it, for test_attach_with_vllm.py: it maps
/dev/shm/vllm_offload_<id>.mmap with vLLM's own SharedOffloadRegion, called exactly as that
release's CPUOffloadingSpec.create_worker calls it (a barrier over all ranks; 0.33 also asks
for 32 segments), carves one view per tensor as CPUOffloadingWorker does, writes its pattern,
then reads the one kvshm wrote. Run inside a mount namespace whose /dev/shm shows the region
(its directory, or links to its files). Prints one JSON line: what it read wrong, the inodes of
the region files it mapped, and the symlinks /dev/shm still holds once it let go."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import vllm
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from tests.against_vllm.patterns import pattern


class FileBarrier:
    """Blocks until every rank has arrived (vLLM uses its gloo group barrier here)."""

    def __init__(self, directory: Path, rank: int, world: int) -> None:
        self.directory, self.rank, self.world, self.generation = directory, rank, world, 0

    def __call__(self) -> None:
        self.generation += 1
        (self.directory / f"barrier.{self.generation}.{self.rank}").touch()
        wait_for(
            lambda: len(list(self.directory.glob(f"barrier.{self.generation}.*"))) == self.world
        )


def wait_for(condition, timeout: float = 120.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the test side never answered")
        time.sleep(0.01)


def mapped_region_inodes() -> list[int]:
    """The inodes of the vllm_offload_* files this process maps (/proc/self/maps)."""
    inodes = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and os.path.basename(fields[5].strip()).startswith("vllm_offload_"):
                inodes.add(int(fields[4]))
    return sorted(inodes)


def main() -> None:
    job = json.loads(sys.argv[1])
    rank, world, sync = job["rank"], job["world"], Path(job["sync_dir"])
    barrier = FileBarrier(sync, rank, world)
    kwargs: dict[str, object] = {}
    if vllm.__version__.startswith("0.33"):
        kwargs["num_segments"] = 32
    # MLA's replicated layout: every worker maps rank 0's cell (identical bytes) and pre-faults
    # its share of the region; vLLM 0.33's create_worker passes exactly this
    slot = 0 if job.get("replicated") else rank
    if job.get("replicated") and "num_segments" in kwargs:  # 0.32 has no populate_shard
        kwargs["populate_shard"] = (rank, world)
    region = SharedOffloadRegion(
        engine_id=job["engine_id"],
        num_chunks=job["num_chunks"],
        rank=slot,
        kv_bytes_per_chunk=job["kv_bytes_per_chunk"],
        cpu_page_size=job["cpu_page_size"],
        barrier=barrier,
        **kwargs,
    )
    views = [region.create_next_worker_view(job["tensor_page"]) for _ in range(job["tensors"])]
    blocks = job.get("blocks") or range(job["num_chunks"])  # large regions: a sample of rows
    for tensor, view in enumerate(views):
        for block in blocks:
            view[block].copy_(pattern("vllm", slot, block, tensor, job["tensor_page"]))
    (sync / f"written.{rank}").touch()
    wait_for((sync / "kvshm-wrote").exists)
    wrong = [
        [block, tensor]
        for tensor, view in enumerate(views)
        for block in blocks
        if not view[block].equal(pattern("kvshm", slot, block, tensor, job["tensor_page"]))
    ]
    created = region._creator
    mapped = mapped_region_inodes()
    region.cleanup()
    links = sorted(entry.name for entry in os.scandir("/dev/shm") if entry.is_symlink())
    print(
        json.dumps(
            {
                "version": vllm.__version__, "creator": created, "wrong": wrong,
                "mapped": mapped, "links": links,
            }
        )
    )  # fmt: skip


if __name__ == "__main__":
    main()
