"""On a GPU, once (issue 34): after an engine restart, loading --chunks warm chunks through the
kvshm plugin against reading the same chunks back through vLLM 0.33's fs tier on the same tmpfs,
then to the GPU, side by side in one run.

  source .gpu/env.sh && python3 bench/warm_restart/gpu.py --json $OUT/warm.json

The KV layout is Llama-3.1-8B at TP 1 (32 layers, 64 KiB a layer's block, one block a chunk:
2 MiB rows), --chunks GPU blocks filled with a random pattern.

- The old engine is a child process: the plugin's scheduler-side manager (warm restart on) and
  its worker store every block into an agent-made region, the manager commits them, and the
  child SIGKILLs itself.
- kvshm, after the restart (this process): a new manager and worker on the same region (the
  worker's first transfer, which calibrates, is made before the clock starts, as an engine's
  first store would); timed: the manager's first call (it restores the index), a lookup of
  every key (all must hit), prepare_load, the worker's loads of every chunk to the GPU, done.
  Then again --rounds - 1 times with a new manager (the index restored again).
- vLLM's fs tier, the baseline: vLLM's TieringOffloadingSpec pieces as it assembles them: its
  primary tier's SharedOffloadRegion (one file in /dev/shm, rank None for the tier's view),
  vLLM's CPUOffloadingWorker on it, and its FileSystemTierManager with its root on the same
  tmpfs. The same GPU pattern is stored by vLLM's worker and cascaded to files by the fs tier
  (untimed); then, per round, the primary rows and the GPU blocks are zeroed and timed: the fs
  tier's load of every chunk's file into the primary tier (its thread pool, its io), then
  vLLM's worker's loads to the GPU. The fs tier's lookups are not timed (they favour fs).

Every round checks the GPU blocks equal the pattern. Prints each path's seconds and GB/s and
the ratio fs / kvshm (above 1: kvshm faster). Exits non-zero if a path could not be measured.
--device cpu runs the same flow on the CPU (the plugin's worker stands in for vLLM's on the fs
path): a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tests.vllm_plugin.layouts import REAL_LAYOUTS, canonical_kv_caches  # noqa: E402
from tests.vllm_plugin.regions import agent_region, remove_region  # noqa: E402

LAYOUT = REAL_LAYOUTS[0]  # llama-3.1-8b-tp1
SHM = "/dev/shm"
PER_JOB = 16  # chunks a transfer job (a request of 16 chunks)


def keys_of(chunks: int) -> list[bytes]:
    from vllm.v1.kv_offload.base import make_offload_key

    return [
        make_offload_key(hashlib.sha256(i.to_bytes(8, "big")).digest(), 0) for i in range(chunks)
    ]


def seed_hashing() -> None:
    """vLLM's block hashing as an engine seeds it (sha256, fixed seed): the manager's
    identity reads it at its first call."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)


def manager(directory: str, instance_id: str, chunks: int) -> Any:
    from kvshm.vllm.warm.manager import KvshmOffloadingManager, WarmStart

    identity = {"bench": "warm_restart_gpu", "layout": LAYOUT.name, "chunks": chunks}
    return KvshmOffloadingManager(chunks, "lru", warm=WarmStart(directory, instance_id, identity))


def plugin_worker(kv: Any, directory: str, instance_id: str, chunks: int) -> Any:
    from kvshm.vllm.attach import attach_region
    from kvshm.vllm.geometry import RegionGeometry
    from kvshm.vllm.worker import KvshmOffloadingWorker

    cell = LAYOUT.worker_bytes_per_block
    geometry = RegionGeometry(chunks, cell, cell, 1, False)
    region = attach_region(directory, instance_id, geometry, 0, 5.0)
    return KvshmOffloadingWorker(
        kv, region, 1, region_dir=directory, instance_id=instance_id, listen_for_drain=False
    )


_next_job = iter(range(1, 1 << 62))


def move(worker: Any, gpu_ids: list[int], cpu_ids: list[int], *, load: bool) -> None:
    """Jobs of PER_JOB chunks through a worker's vLLM 0.33 contract, waited for."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    ids: set[int] = set()
    for i in range(0, len(gpu_ids), PER_JOB):
        gpu = gpu_ids[i : i + PER_JOB]
        gpu_spec = GPULoadStoreSpec(gpu, [len(gpu)], [0])
        cpu_spec = CPULoadStoreSpec(cpu_ids[i : i + PER_JOB])
        ids.add(job := next(_next_job))
        if load:
            assert worker.submit_load(job, cpu_spec, gpu_spec), f"load job {job} refused"
        else:
            assert worker.submit_store(job, gpu_spec, cpu_spec), f"store job {job} refused"
    worker.wait(ids)
    while ids:
        for result in worker.get_finished():
            assert result.success, f"job {result.job_id} failed"
            ids.discard(result.job_id)
        if ids:
            time.sleep(0.0001)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def tensors(kv: Any) -> list[torch.Tensor]:
    return [t.tensor for t in kv.tensors]


def same(kv: Any, expected: list[torch.Tensor], chunks: int) -> bool:
    return all(
        torch.equal(t[:chunks], e[:chunks]) for t, e in zip(tensors(kv), expected, strict=True)
    )


# -- the old engine --------------------------------------------------------------------------


def old_engine(args: argparse.Namespace) -> None:
    """Store every block through the plugin, commit, and die by SIGKILL."""
    from vllm.v1.kv_offload.base import ReqContext

    seed_hashing()
    chunks = args.chunks
    kv = canonical_kv_caches(LAYOUT, chunks + 1, args.device, seed=0)
    worker = plugin_worker(kv, args.directory, args.instance, chunks)
    old = manager(args.directory, args.instance, chunks)
    keys = keys_of(chunks)
    context = ReqContext(req_id="old-engine")
    old.on_new_request(context)
    out = old.prepare_store(keys, context)
    assert list(out.keys_to_store) == keys, "the new index's tier did not take every key"
    started = time.perf_counter()
    move(worker, list(range(chunks)), out.store_spec.block_ids.tolist(), load=False)
    synchronize(args.device)
    seconds = time.perf_counter() - started
    old.complete_store(keys, context)
    old.on_request_finished(context)
    old.on_schedule_end(None)
    print(json.dumps({"stored": chunks, "store_s": seconds}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def run_old_engine(args: argparse.Namespace, instance: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--old-engine", "--instance", instance]
    command += ["--chunks", str(args.chunks), "--directory", args.directory]
    command += ["--device", args.device]
    child = subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)
    lines = [line for line in child.stdout.splitlines() if line.startswith("{")]
    if child.returncode != -signal.SIGKILL or not lines:
        raise RuntimeError(
            f"the old engine exited {child.returncode}: {child.stdout[-1500:]}"
            f"{child.stderr[-3000:]}"
        )
    found: dict[str, Any] = json.loads(lines[-1])
    return found


# -- kvshm after the restart -----------------------------------------------------------------


def kvshm_round(
    args: argparse.Namespace, instance: str, kv: Any, expected: list[torch.Tensor], worker: Any
) -> dict[str, Any]:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    chunks = args.chunks
    keys = keys_of(chunks)
    for t in tensors(kv):
        t.zero_()
    synchronize(args.device)
    new = manager(args.directory, instance, chunks)
    context = ReqContext(req_id="restarted")
    started = time.perf_counter()
    new.on_new_request(context)  # the first call: the index is restored here
    restored = time.perf_counter()
    hits = sum(new.lookup(key, context) is LookupResult.HIT for key in keys)
    spec = new.prepare_load(keys, context)
    looked = time.perf_counter()
    move(worker, list(range(chunks)), spec.block_ids.tolist(), load=True)
    synchronize(args.device)
    done = time.perf_counter()
    new.complete_load(keys, context)
    new.on_request_finished(context)
    outcome = new.warm_outcome
    new.shutdown()
    return {
        "hits": hits,
        "restored_chunks": outcome.chunks if outcome is not None else 0,
        "outcome": outcome.state if outcome is not None else None,
        "restore_s": restored - started,
        "lookup_and_prepare_s": looked - restored,
        "transfer_s": done - looked,
        "total_s": done - started,
        "bytes_equal": same(kv, expected, chunks),
    }


# -- vLLM's fs tier --------------------------------------------------------------------------


def fs_spec(chunks: int) -> Any:
    """What vLLM's FileSystemTierManager reads of its OffloadingSpec (FileMapper's fields, the
    chunk's blocks, whether KV events are on), as vLLM's spec holds them for this engine."""
    config = SimpleNamespace(
        model=SimpleNamespace(name="meta-llama/Llama-3.1-8B-Instruct", dtype="bfloat16"),
        cache=SimpleNamespace(tokens_per_hash=16),
        groups=[
            SimpleNamespace(
                tokens_per_block=16,
                layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(LAYOUT.layers)],
            )
        ],
        parallel=SimpleNamespace(
            tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, is_parallelism_agnostic=False
        ),
        canonical_layout=False,
        kv_cache_layout=None,
        replicated_layout=False,
    )
    return SimpleNamespace(
        config=config,
        blocks_per_chunk=1,
        kv_events_config=SimpleNamespace(enable_kv_cache_events=False),
    )


class FsPath:
    """vLLM's primary tier region, its CPUOffloadingWorker, and its fs tier on the tmpfs."""

    def __init__(self, args: argparse.Namespace, kv: Any, root: str) -> None:
        from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        chunks, cell = args.chunks, LAYOUT.worker_bytes_per_block
        self.engine_id = f"kvshm-bench-fs-{uuid.uuid4().hex[:8]}"
        self.path = f"{SHM}/vllm_offload_{self.engine_id}.mmap"
        self.device = args.device
        self.chunks = chunks
        # as TieringOffloadingSpec.get_manager: the scheduler's region first (rank None)
        self.primary = SharedOffloadRegion(
            engine_id=self.engine_id,
            num_chunks=chunks,
            rank=None,
            kv_bytes_per_chunk=cell,
            cpu_page_size=cell,
        )
        self.view = self.primary.create_kv_memoryview()
        self.rows = np.asarray(self.view)
        self.tier = FileSystemTierManager(fs_spec(chunks), self.view, "fs", root_dir=root)
        self.worker_note = "vLLM's CPUOffloadingWorker"
        if args.device == "cuda":
            from vllm.v1.kv_offload.cpu.gpu_worker import CPUOffloadingWorker

            # as TieringOffloadingSpec.create_worker: rank 0's region, the same file
            region = SharedOffloadRegion(
                engine_id=self.engine_id,
                num_chunks=chunks,
                rank=0,
                kv_bytes_per_chunk=cell,
                cpu_page_size=cell,
            )
            self.worker = CPUOffloadingWorker(
                kv_caches=kv, blocks_per_chunk=1, num_cpu_chunks=chunks, mmap_region=region
            )
        else:  # a check of the flow only: vLLM's worker needs CUDA
            from kvshm.region import OpenMode, RegionFormat, RegionLayout
            from kvshm.region import SharedOffloadRegion as KvshmRegion
            from kvshm.vllm.worker import KvshmOffloadingWorker

            layout = RegionLayout(chunks, cell, 1, RegionFormat.VLLM_0_27)
            region = KvshmRegion(
                self.engine_id, layout, directory=SHM, mode=OpenMode.ATTACH, rank=0
            )
            self.worker = KvshmOffloadingWorker(
                kv, region, 1, region_dir=SHM, instance_id=self.engine_id, listen_for_drain=False
            )
            self.worker_note = "kvshm's worker standing in (--device cpu: no measurement)"

    def _tier_job(self, keys: list[bytes], *, load: bool) -> None:
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.base import TransferJob

        job = TransferJob(
            job_id=next(_next_job),
            keys=keys,
            chunk_ids=np.arange(len(keys), dtype=np.int64),
            is_promotion=load,
            req_context=ReqContext(req_id="fs"),
        )
        (self.tier.submit_load if load else self.tier.submit_store)(job)
        while True:
            finished = list(self.tier.get_finished_jobs())
            if finished:
                (result,) = finished
                assert result.job_id == job.job_id and result.success, f"fs job: {result}"
                return
            time.sleep(0.0001)

    def fill(self, keys: list[bytes]) -> float:
        """The pattern GPU -> primary tier (vLLM's worker) -> files (the fs tier's cascade)."""
        move(self.worker, list(range(self.chunks)), list(range(self.chunks)), load=False)
        synchronize(self.device)
        started = time.perf_counter()
        self._tier_job(keys, load=False)
        return time.perf_counter() - started

    def round(self, keys: list[bytes], kv: Any, expected: list[torch.Tensor]) -> dict[str, Any]:
        self.rows[:] = 0
        for t in tensors(kv):
            t.zero_()
        synchronize(self.device)
        started = time.perf_counter()
        self._tier_job(keys, load=True)
        read = time.perf_counter()
        move(self.worker, list(range(self.chunks)), list(range(self.chunks)), load=True)
        synchronize(self.device)
        done = time.perf_counter()
        return {
            "fs_read_s": read - started,
            "transfer_s": done - read,
            "total_s": done - started,
            "bytes_equal": same(kv, expected, self.chunks),
        }

    def close(self) -> None:
        """Each step on its own: one that fails leaves the file removed all the same."""
        steps = (
            self.tier.shutdown,
            self.worker.shutdown,
            self._release_view,
            self.primary.cleanup,
        )
        for step in steps:
            try:
                step()
            except Exception as exc:
                print(f"closing the fs path: {step.__name__}: {exc!r}")
        Path(self.path).unlink(missing_ok=True)

    def _release_view(self) -> None:
        del self.rows
        self.view.release()


# -- the run ---------------------------------------------------------------------------------


NEEDED = (
    "vllm.v1.kv_offload.cpu.gpu_worker",
    "vllm.v1.kv_offload.cpu.shared_offload_region",
    "vllm.v1.kv_offload.tiering.fs.manager",
    "vllm.v1.core.kv_cache_utils",
    "kvshm.vllm.warm.manager",
    "kvshm.vllm.worker",
)


def preflight() -> str | None:
    """Import every module the run needs, before anything is made: a package this machine
    lacks fails the run in seconds, named. The scheduler-side modules (vLLM's
    CPUOffloadingManager, its block hashing, the fs tier's file mapper) import vllm.config,
    hence pydantic and transformers, which the worker-only GPU tests never needed."""
    import importlib

    for module in NEEDED:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return (
                f"importing {module} failed: {exc!r}. vLLM 0.33's scheduler side needs its "
                f"Python dependencies (pydantic, transformers, ...): install them, or carry "
                f"their wheels in .gpu/whl (scripts/prepare-gpu-env.sh)"
            )
    return None


def median(rows: list[dict[str, Any]], name: str) -> float:
    return statistics.median(row[name] for row in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--directory", help="the kvshm region's directory (default: a new one)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--old-engine", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--instance", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.device == "cuda":
        # before any vLLM worker module binds vllm.platforms.current_platform at its import
        from bench.vllm_plugin.baseline import vllm_dma_note, vllm_platform_note

        platform, dma = vllm_platform_note(), vllm_dma_note()
    else:
        platform = dma = "--device cpu"
    missing = preflight()
    if missing is not None:
        print(f"PROBLEM: {missing}")
        if args.json:
            Path(args.json).write_text(json.dumps({"problems": [missing]}, indent=2))
        sys.exit(2)
    if args.old_engine:
        old_engine(args)
        return
    made = args.directory is None
    directory = args.directory or tempfile.mkdtemp(prefix="kvshm-bench-warm-", dir=SHM)
    args.directory = directory
    fs_root = tempfile.mkdtemp(prefix="kvshm-bench-fs-tier-", dir=SHM)
    instance = f"kvshm-bench-warm-{uuid.uuid4().hex[:8]}"
    chunks = args.chunks
    nbytes = chunks * LAYOUT.worker_bytes_per_block
    problems: list[str] = []
    figures: dict[str, Any] = {
        "chunks": chunks,
        "layout": LAYOUT.name,
        "bytes": nbytes,
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "vllm_platform": platform,
        "vllm_dma": dma,
    }
    fs = None
    worker = None
    try:
        agent_region(directory, instance, chunks, LAYOUT.worker_bytes_per_block, 1)
        figures["old_engine"] = run_old_engine(args, instance)  # stores, commits, SIGKILLed
        seed_hashing()
        kv = canonical_kv_caches(LAYOUT, chunks + 1, args.device, seed=0)
        expected = [t.clone() for t in tensors(kv)]
        started = time.perf_counter()
        worker = plugin_worker(kv, directory, instance, chunks)
        move(worker, [chunks], [0], load=True)  # its first transfer (calibration), untimed
        synchronize(args.device)
        figures["kvshm_worker_start_s"] = time.perf_counter() - started
        kvshm_rows = [kvshm_round(args, instance, kv, expected, worker) for _ in range(args.rounds)]
        figures["kvshm"] = kvshm_rows
        worker.shutdown()
        worker = None
        first = kvshm_rows[0]
        if first["hits"] != chunks or not all(row["bytes_equal"] for row in kvshm_rows):
            problems.append(
                f"kvshm: {first['hits']}/{chunks} hits, bytes equal: "
                f"{[row['bytes_equal'] for row in kvshm_rows]}"
            )
        for t, e in zip(tensors(kv), expected, strict=True):
            t.copy_(e)
        fs = FsPath(args, kv, fs_root)
        figures["fs_worker"] = fs.worker_note
        keys = keys_of(chunks)
        figures["fs_cascade_s"] = fs.fill(keys)
        move(fs.worker, [chunks], [0], load=True)  # its first load, untimed
        fs_rows = [fs.round(keys, kv, expected) for _ in range(args.rounds)]
        figures["fs"] = fs_rows
        if not all(row["bytes_equal"] for row in fs_rows):
            problems.append("fs: the GPU blocks differ from the pattern after a round")
        ratio = median(fs_rows, "total_s") / median(kvshm_rows, "total_s")
        figures["ratio_fs_over_kvshm"] = ratio
        figures["ratio_first_restart"] = median(fs_rows, "total_s") / first["total_s"]
        report(figures, nbytes)
    except Exception as exc:  # a figure this run could not make: say so, exit non-zero
        problems.append(f"{type(exc).__name__}: {exc}")
        import traceback

        traceback.print_exc()
    finally:
        if worker is not None:
            worker.shutdown()
        if fs is not None:
            fs.close()
        remove_region(directory, instance)
        Path(directory, f"vllm_offload_{instance}.index").unlink(missing_ok=True)
        if made:
            shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(fs_root, ignore_errors=True)
    figures["problems"] = problems
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str))
    for line in problems:
        print(f"PROBLEM: {line}")
    sys.exit(1 if problems else 0)


def report(figures: dict[str, Any], nbytes: int) -> None:
    kvshm_rows, fs_rows = figures["kvshm"], figures["fs"]
    print(
        f"{figures['device']}: {figures['chunks']} chunks of {figures['layout']} "
        f"({nbytes / 2**30:.2f} GiB); vLLM: {figures['vllm_platform']}; {figures['vllm_dma']}"
    )
    old = figures["old_engine"]
    print(
        f"old engine: stored {old['stored']} chunks through the plugin in {old['store_s']:.3f} s,"
        f" then SIGKILLed"
    )
    first = kvshm_rows[0]
    print(
        f"restarted: {first['outcome']}, {first['restored_chunks']} chunks restored, "
        f"{first['hits']} hits"
    )
    print("\nseconds, median of rounds (first restart for kvshm in brackets)")
    print("path   restore/read  lookup   to GPU   total    GB/s")
    k_total = median(kvshm_rows, "total_s")
    print(
        f"kvshm  {median(kvshm_rows, 'restore_s'):<12.4f}  "
        f"{median(kvshm_rows, 'lookup_and_prepare_s'):<7.4f}  "
        f"{median(kvshm_rows, 'transfer_s'):<7.4f}  {k_total:<7.4f}  "
        f"{nbytes / k_total / 1e9:.1f}   [{first['total_s']:.4f}]"
    )
    f_total = median(fs_rows, "total_s")
    print(
        f"fs     {median(fs_rows, 'fs_read_s'):<12.4f}  {'-':<7}  "
        f"{median(fs_rows, 'transfer_s'):<7.4f}  {f_total:<7.4f}  {nbytes / f_total / 1e9:.1f}"
    )
    print(
        f"\nfs / kvshm: {figures['ratio_fs_over_kvshm']:.2f}x (first restart "
        f"{figures['ratio_first_restart']:.2f}x); fs files written by vLLM's cascade in "
        f"{figures['fs_cascade_s']:.3f} s; fs path's worker: {figures['fs_worker']}"
    )


if __name__ == "__main__":
    main()
