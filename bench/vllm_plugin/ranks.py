"""Tensor-parallel ranks on their own GPUs, one region: each rank's GB/s alone and beside the
others (the host's memory and the links are shared), one way and both ways.

Each rank is its own process with the plugin's worker (kvshm.vllm.worker) on its own GPU,
attached to its cell of one agent-made region (vLLM 0.33's format, >= 4 GiB, segmented) and
registered with CUDA in that process, moving random blocks of a real layout (Llama-3.1-8B at
TP 2 by default: 32 layers, 16 KiB K or V pages per rank). Every run lasts --seconds, starting
at the same instant in every rank that takes part; a rank reports the bytes of the passes it
finished in that time. The baseline, each rank alone, is measured in the same run. The ranks
choose their backends by block size (the handlers' policy), not by measurement, so that the
ranks' figures do not depend on which rank measured first.

Run on a machine with two (or more) GPUs from the repository root, vLLM importable:
    source .gpu/env.sh && python3 bench/vllm_plugin/ranks.py
        [--gpus 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

from bench.vllm_plugin import jobs as plugin_jobs  # noqa: E402
from tests.vllm_plugin.layouts import KvLayout, canonical_kv_caches  # noqa: E402
from tests.vllm_plugin.regions import agent_region, remove_region  # noqa: E402

KIB, GIB = 1024, 1 << 30
SHM = "/dev/shm"
TP2 = KvLayout("llama-3.1-8b-tp2", 32, 2 * 16 * KIB)  # 8 KV heads / 2: 16 KiB per K or V page
DIRECTIONS = ("H2D", "D2H", "both")


def rank_main(args: argparse.Namespace) -> None:
    """One rank: attach, warm up, then run what the parent asks, at the instant it names."""
    import torch

    from kvshm.vllm.attach import attach_region
    from kvshm.vllm.geometry import RegionGeometry
    from kvshm.vllm.worker import KvshmOffloadingWorker

    device = f"cuda:{args.rank}"
    torch.cuda.set_device(device)
    cell = TP2.worker_bytes_per_block
    geometry = RegionGeometry(args.chunks, cell * args.gpus, cell, args.gpus, False)
    region = attach_region(SHM, args.instance_id, geometry, args.rank, 10.0)
    kv = canonical_kv_caches(TP2, args.blocks, device, seed=args.rank)
    worker = KvshmOffloadingWorker(
        kv, region, 1, region_dir=SHM, instance_id=args.instance_id, listen_for_drain=False
    )
    jobs = plugin_jobs.plan(TP2, args.blocks, args.job_blocks, seed=args.rank)
    for direction in DIRECTIONS:  # the first transfer waits for registration and calibration
        plugin_jobs.issue_and_wait(worker, *jobs.jobs[direction])
    print(f"READY {json.dumps(worker.chosen_backends)}", flush=True)
    for line in sys.stdin:
        command = line.split()
        if command[0] == "STOP":
            break
        direction, start_at, seconds = command[1], float(command[2]), float(command[3])
        stores, loads = jobs.jobs[direction]
        time.sleep(max(0.0, start_at - time.time()))
        started = time.perf_counter()
        moved = 0
        while time.perf_counter() - started < seconds:
            plugin_jobs.issue_and_wait(worker, stores, loads)
            moved += jobs.nbytes[direction]
        rate = moved / (time.perf_counter() - started) / 1e9
        print(f"RESULT {direction} {rate:.3f}", flush=True)
    worker.shutdown()


def start_rank(rank: int, args: argparse.Namespace, instance_id: str, chunks: int) -> Any:
    command = [
        sys.executable,
        __file__,
        "--rank",
        str(rank),
        "--instance-id",
        instance_id,
        "--chunks",
        str(chunks),
        "--gpus",
        str(args.gpus),
        "--blocks",
        str(args.blocks),
        "--job-blocks",
        str(args.job_blocks),
    ]
    return subprocess.Popen(
        command, cwd=REPO, env=os.environ, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def read(process: Any, prefix: str) -> str:
    for line in process.stdout:
        if line.startswith(prefix):
            return str(line[len(prefix) :].strip())
    raise SystemExit(f"a rank exited ({process.wait()}) before printing {prefix.strip()}")


def measure(ranks: list[Any], who: list[int], direction: str, seconds: float) -> list[float]:
    start_at = time.time() + 0.5
    for r in who:
        ranks[r].stdin.write(f"RUN {direction} {start_at} {seconds}\n")
        ranks[r].stdin.flush()
    return [float(read(ranks[r], f"RESULT {direction} ")) for r in who]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=2048, help="GPU blocks per rank (1 MiB)")
    parser.add_argument("--job-blocks", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--json")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--instance-id", help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args)
        return
    import torch

    if torch.cuda.device_count() < args.gpus:
        sys.exit(f"needs {args.gpus} GPUs, found {torch.cuda.device_count()}")
    row = TP2.worker_bytes_per_block * args.gpus
    chunks = max(args.blocks, -(-4 * GIB // row))
    instance_id = f"kvshm-bench-ranks-{uuid.uuid4().hex[:8]}"
    agent_region(SHM, instance_id, chunks, TP2.worker_bytes_per_block, args.gpus)
    ranks: list[Any] = []
    try:
        ranks = [start_rank(r, args, instance_id, chunks) for r in range(args.gpus)]
        chosen = [read(p, "READY ") for p in ranks]
        names = [torch.cuda.get_device_name(r) for r in range(args.gpus)]
        print(f"{args.gpus} ranks on {names}; region {chunks * row / GIB:.1f} GiB; {TP2.name}")
        print(f"backends chosen by each rank: {chosen}")
        print(f"{'':6} {'rank':>4} {'alone':>7} {'beside':>7} {'ratio':>6}")
        results: dict[str, Any] = {}
        everyone = list(range(args.gpus))
        for direction in DIRECTIONS:
            alone = [measure(ranks, [r], direction, args.seconds)[0] for r in everyone]
            beside = measure(ranks, everyone, direction, args.seconds)
            for r in everyone:
                print(
                    f"{direction:6} {r:>4} {alone[r]:7.1f} {beside[r]:7.1f} "
                    f"{beside[r] / alone[r]:6.2f}"
                )
            print(f"{direction:6} {'all':>4} {'':>7} {sum(beside):7.1f}")
            results[direction] = {"alone": alone, "beside": beside, "total": sum(beside)}
        for process in ranks:
            process.stdin.write("STOP\n")
            process.stdin.flush()
            process.wait(timeout=60)
        if args.json:
            Path(args.json).write_text(json.dumps({"gpus": names, "results": results}, indent=2))
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
        remove_region(SHM, instance_id)


if __name__ == "__main__":
    main()
