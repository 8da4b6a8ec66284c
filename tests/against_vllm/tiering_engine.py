"""One engine's scheduler side as vLLM 0.33 builds it for `--kv-transfer-config` naming its own
TieringOffloadingSpec with an fs secondary tier, for test_tiering_on_agent_region.py: vLLM's
EngineArgs, build_offloading_config and OffloadingSpecFactory make the spec, and its own
get_manager() maps the primary tier's region at /dev/shm/vllm_offload_<engine_id>.mmap. Run in
a mount namespace whose /dev/shm is the directory of a region the agent made.

`store`: the chunks of KEYS are stored in the primary tier, their rows written by kvshm as a
worker's transfer would, and vLLM cascades them to the fs tier. `restart`: a new engine, whose
primary tier starts empty, finds each key in the fs tier, promotes it into the region, and
prints the rows it was given. Prints one JSON line.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvshm.region import RegionFormat, RegionLayout
from tests.agent_region import attach_as_worker
from tests.vllm_plugin.engine import GPU_BLOCKS, offloading_spec, vllm_config, write_model

SHM = Path("/dev/shm")


def keys(count: int) -> list[Any]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [
        make_offload_key(hashlib.sha256(i.to_bytes(8, "big")).digest(), 0) for i in range(count)
    ]


def row_bytes(key_index: int, size: int) -> np.ndarray:
    """What the store writes into the row of key `key_index`: every row's bytes differ."""
    return ((np.arange(size, dtype=np.int64) * 7 + key_index * 31) % 256).astype(np.uint8)


def until(condition: Any, manager: Any, what: str, timeout: float = 60.0) -> None:
    """Run scheduler steps until `condition()` holds (vLLM's tiers finish jobs on threads)."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"vLLM's tiering manager did not {what} in {timeout} s")
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=set(), preempted_req_ids=set()))
        time.sleep(0.01)


def main() -> None:
    job = json.loads(sys.argv[1])
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    model = write_model(Path(job["work"]) / "model")
    transfer = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": job["engine_id"],
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": job["cpu_bytes"],
            "secondary_tiers": [{"type": "fs", "root_dir": job["fs_root"]}],
        },
    }
    spec = offloading_spec(vllm_config(model, json.dumps(transfer)), GPU_BLOCKS)
    manager = spec.get_manager()
    geometry = {
        "spec": type(spec).__name__,
        "num_chunks": spec.num_chunks,
        "kv_bytes_per_chunk": spec.kv_bytes_per_chunk,
        "engine_id": spec._engine_id,
    }
    cell = spec.cpu_page_size_per_worker
    layout = RegionLayout(spec.num_chunks, cell, 1, RegionFormat.VLLM_0_33)
    region = attach_as_worker(SHM, job["engine_id"], layout, 0)
    rows = region.create_next_view(cell).numpy().view(np.uint8)
    chunk_keys = keys(job["keys"])
    context = ReqContext(req_id=job["phase"])
    manager.on_new_request(context)
    found: dict[str, Any] = {}
    try:
        if job["phase"] == "store":
            out = manager.prepare_store(chunk_keys, context)
            assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
            chunk_ids = [int(c) for c in out.store_spec.chunk_ids]
            for index, chunk in enumerate(chunk_ids):  # the worker's GPU -> region transfer
                rows[chunk] = row_bytes(index, cell)
            manager.complete_store(chunk_keys, context)
            manager.on_request_finished(context)
            fs_root = Path(job["fs_root"])
            until(
                lambda: (
                    len([p for p in fs_root.rglob("*") if p.suffix == ".bin"]) >= len(chunk_keys)
                    and not manager.has_pending_work()
                ),
                manager,
                "write every chunk to the fs tier",
            )
            found = {"chunk_ids": chunk_ids}
        else:
            results: dict[int, LookupResult] = {}

            def all_hit() -> bool:
                for index, key in enumerate(chunk_keys):
                    if results.get(index) is not LookupResult.HIT:
                        results[index] = manager.lookup(key, context)
                return all(result is LookupResult.HIT for result in results.values())

            first = [manager.lookup(key, context).name for key in chunk_keys]
            until(all_hit, manager, "promote every chunk from the fs tier")
            load = manager.prepare_load(chunk_keys, context)
            assert isinstance(load, CPULoadStoreSpec)
            chunk_ids = [int(c) for c in load.chunk_ids]
            wrong = [
                index
                for index, chunk in enumerate(chunk_ids)
                if not np.array_equal(rows[chunk], row_bytes(index, cell))
            ]
            manager.complete_load(chunk_keys, context)
            manager.on_request_finished(context)
            found = {"first_lookups": first, "chunk_ids": chunk_ids, "wrong": wrong}
    finally:
        del rows
        region.cleanup()
        manager.shutdown()
    print(json.dumps({**geometry, **found}))


if __name__ == "__main__":
    main()
