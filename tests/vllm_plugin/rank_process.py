"""One tensor-parallel rank of an engine, as its own process: the plugin's worker attaches the
region's cell `rank` (and registers it with CUDA in this process), stores random jobs, loads
them back into other GPU blocks and compares them there, prints what it stored, then waits for
a line on stdin (or, with --forever, keeps storing until killed).

    python -m tests.vllm_plugin.rank_process DIR ID --rank R --workers W --chunks C --layers L
        --page P --gpu-blocks G [--device cuda] [--forever]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import numpy as np
import torch

from kvshm.vllm.attach import attach_region
from kvshm.vllm.geometry import RegionGeometry
from kvshm.vllm.worker import KvshmOffloadingWorker
from tests.vllm_plugin.checks import finish
from tests.vllm_plugin.jobs import Job, random_job
from tests.vllm_plugin.layouts import KvLayout, canonical_kv_caches


def load_back(worker: Any, kv: Any, jobs: list[Job], rng: Any, last_id: int) -> int:
    """Load every stored chunk into other (random, unused) GPU blocks, concurrently with the
    other rank's work, and compare on the GPU; returns the pages compared."""
    stored = [b for job in jobs for b in job.gpu_ids]
    free = rng.permutation([b for b in range(kv.tensors[0].tensor.shape[0]) if b not in stored])
    targets, at, ids = [], 0, set()
    for n, job in enumerate(jobs):
        to = [int(b) for b in free[at : at + len(job.gpu_ids)]]
        at += len(to)
        targets.append(to)
        back = Job(to, job.cpu_ids, [len(to)], [0])
        gpu, cpu = back.specs()
        worker.submit_load(last_id + n + 1, cpu, gpu)
        ids.add(last_id + n + 1)
    finish(worker, ids)
    pages = 0
    for job, to in zip(jobs, targets, strict=True):
        for tensor in kv.tensors:
            data = tensor.tensor
            assert torch.equal(data[job.gpu_ids], data[to]), "a loaded page differs"
            pages += len(to)
    return pages


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("instance_id")
    for name in ("rank", "workers", "chunks", "layers", "page", "gpu_blocks"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--forever", action="store_true")
    args = parser.parse_args()
    layout = KvLayout("rank", args.layers, args.page)
    cell = layout.worker_bytes_per_block
    geometry = RegionGeometry(args.chunks, cell * args.workers, cell, args.workers, False)
    region = attach_region(args.directory, args.instance_id, geometry, args.rank, 10.0)
    kv = canonical_kv_caches(layout, args.gpu_blocks, args.device, seed=100 + args.rank)
    worker = KvshmOffloadingWorker(
        kv,
        region,
        1,
        region_dir=args.directory,
        instance_id=args.instance_id,
        listen_for_drain=False,
    )
    rng = np.random.default_rng(args.rank)
    per_job = max(1, args.gpu_blocks // 8)
    used: list[int] = []
    jobs = []
    for _ in range(4):  # distinct chunks for every job, so the last write of each is known
        job = random_job(rng, args.gpu_blocks, args.chunks, 1, [per_job], [0], used)
        used += job.cpu_ids
        jobs.append(job)
    job_id = 0
    for job in jobs:
        job_id += 1
        worker.submit_store(job_id, *job.specs())
    finish(worker, set(range(1, job_id + 1)))
    loaded = load_back(worker, kv, jobs, rng, job_id)
    job_id += len(jobs)
    stored = [{"gpu": j.gpu_ids, "cpu": j.cpu_ids} for j in jobs]
    print(f"LOADED {loaded}", flush=True)
    print("STORED " + json.dumps(stored), flush=True)
    if args.forever:  # rewrite the same bytes until killed: a kill lands mid-transfer
        while True:
            ids = set()
            for job in jobs:
                job_id += 1
                worker.submit_store(job_id, *job.specs())
                ids.add(job_id)
            finish(worker, ids)
    sys.stdin.readline()
    worker.shutdown()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
