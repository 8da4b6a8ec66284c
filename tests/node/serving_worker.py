"""The stand-in for vLLM's container in the node tier's serving pod (examples/serving with its
vLLM container replaced): one process per tensor-parallel rank attaches the agent's region, as
vLLM 0.33's own code attaches it (mode "vllm": its SharedOffloadRegion, called as
CPUOffloadingSpec.create_worker calls it) or as kvshm's plugin does (mode "plugin":
kvshm.vllm.attach.attach_region, with its drain listener). Each rank writes a pattern into its
cell of every block and reads it back, then holds the region; /health answers 200 once every
rank has. In plugin mode a drain event makes each rank let go and the container exit.

Runs inside the serving image (mounted from a ConfigMap); it imports nothing of the tests.
Prints one JSON line per event.
"""

from __future__ import annotations

import http.server
import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

SHM = "/dev/shm"
SYNC = Path(os.environ.get("KVSHM_SYNC_DIR", "/sync"))
PATTERN_BYTES = 64


def pattern(rank: int, block: int) -> bytes:
    """What rank `rank` writes at the start of its cell of block `block`."""
    return bytes((rank * 7 + block * 13 + i) % 256 for i in range(PATTERN_BYTES))


def say(**event: object) -> None:
    print(json.dumps(event), flush=True)


def barrier(rank: int, world: int, generation: list[int]) -> None:
    """vLLM uses its gloo group's barrier here; the ranks share an emptyDir instead."""
    generation[0] += 1
    (SYNC / f"barrier.{generation[0]}.{rank}").touch()
    while len(list(SYNC.glob(f"barrier.{generation[0]}.*"))) < world:
        time.sleep(0.01)


def cell(job: dict[str, int], rank: int) -> int:
    """The cell of a row this rank uses: with the replicated layout (MLA) every rank's is 0."""
    return 0 if job.get("replicated") else rank


def attach_with_vllm(job: dict[str, int], rank: int) -> tuple[object, object]:
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    generation = [0]
    region = SharedOffloadRegion(
        engine_id=job["instance_id"],
        num_chunks=job["num_blocks"],
        rank=cell(job, rank),
        kv_bytes_per_chunk=job["row_stride"],
        cpu_page_size=job["cpu_page_size"],
        barrier=lambda: barrier(rank, job["world"], generation),
        num_segments=32,
        # as CPUOffloadingSpec.create_worker: each rank pre-faults its share of a replicated one
        populate_shard=(rank, job["world"]) if job.get("replicated") else None,
    )
    return region, region.create_next_worker_view(job["cpu_page_size"])


def attach_with_plugin(job: dict[str, int], rank: int) -> tuple[object, object]:
    from kvshm.vllm.attach import attach_region
    from kvshm.vllm.geometry import RegionGeometry

    geometry = RegionGeometry(
        job["num_blocks"], job["row_stride"], job["cpu_page_size"], job["world"],
        bool(job.get("replicated")),
    )  # fmt: skip
    region = attach_region(SHM, job["instance_id"], geometry, rank, attach_timeout_s=60)
    return region, region.create_next_view(job["cpu_page_size"])


def rank_main(mode: str, job: dict[str, int], rank: int) -> None:
    import torch

    attach = attach_with_vllm if mode == "vllm" else attach_with_plugin
    region, view = attach(job, rank)
    slot = cell(job, rank)
    for block in range(job["num_blocks"]):
        written = torch.frombuffer(bytearray(pattern(slot, block)), dtype=torch.int8)
        view[block][:PATTERN_BYTES].copy_(written)  # type: ignore[index]
    wrong = [
        block
        for block in range(job["num_blocks"])
        if bytes(view[block][:PATTERN_BYTES].numpy().tobytes()) != pattern(slot, block)  # type: ignore[index]
    ]
    say(
        event="verified", mode=mode, instance=job["instance_id"], rank=rank,
        blocks=job["num_blocks"], wrong=wrong,
    )  # fmt: skip
    (SYNC / f"verified.{rank}").touch()
    if mode == "vllm":
        while True:  # vLLM holds its mapping until the engine exits
            time.sleep(3600)
    from kvshm.vllm.events import DrainListener

    drained = threading.Event()
    listener = DrainListener(SHM, str(job["instance_id"]), lambda drain: drained.set())
    if not listener.wait_listening(60):
        say(event="not-listening", rank=rank)
    drained.wait()
    del view
    region.cleanup()  # type: ignore[attr-defined]
    say(event="drained", rank=rank)


class Health(http.server.BaseHTTPRequestHandler):
    world = 0

    def do_GET(self) -> None:
        ready = len(list(SYNC.glob("verified.*"))) >= self.world
        self.send_response(200 if ready else 503)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    mode = sys.argv[1]
    job = json.loads(sys.argv[2])
    SYNC.mkdir(parents=True, exist_ok=True)
    for stale in SYNC.iterdir():  # a restarted container starts over
        stale.unlink()
    Health.world = job["world"]
    server = http.server.ThreadingHTTPServer(("0.0.0.0", job.get("port", 8000)), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=rank_main, args=(mode, job, r)) for r in range(job["world"])]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    say(event="exited", codes=[p.exitcode for p in ranks])
    sys.exit(max(abs(p.exitcode or 0) for p in ranks))


if __name__ == "__main__":
    main()
