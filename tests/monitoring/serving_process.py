"""A stand-in serving process for the end-to-end test: attaches to a region the agent made, moves
blocks both ways with kvshm.transfer's handlers (CPU backend: no GPU here), and serves the
process's default registry, where kvshm_transfer_* live, as vLLM's /metrics would.

    python -m tests.monitoring.serving_process --dir D --instance-id I --num-blocks N \
        --cpu-page-size P --num-workers W --port PORT
"""

from __future__ import annotations

import argparse
import signal
import threading

import numpy as np
import torch
from prometheus_client import start_http_server

from kvshm.region import RegionLayout, SharedOffloadRegion
from kvshm.region.shared_region import OpenMode
from kvshm.transfer import (
    CanonicalKVCacheRef,
    CPULoadStoreSpec,
    GPULoadStoreSpec,
    HandlerAssembly,
    HandlerLayout,
)

MAX_BLOCKS_PER_JOB = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--instance-id", required=True)
    parser.add_argument("--num-blocks", type=int, required=True)
    parser.add_argument("--cpu-page-size", type=int, required=True)
    parser.add_argument("--num-workers", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pause-seconds", type=float, default=0.02)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    region = SharedOffloadRegion(
        args.instance_id,
        RegionLayout(args.num_blocks, args.cpu_page_size, args.num_workers),
        0,
        directory=args.dir,
        mode=OpenMode.ATTACH,
    )
    gpu = [torch.zeros((args.num_blocks, args.cpu_page_size), dtype=torch.int8)]
    refs = [[CanonicalKVCacheRef(0, args.cpu_page_size)]]
    handlers = HandlerAssembly(HandlerLayout.over_region(gpu, region, 1, refs)).build()
    start_http_server(args.port, addr="127.0.0.1")
    print(f"serving metrics on 127.0.0.1:{args.port}", flush=True)
    rng = np.random.default_rng(0)
    job_id = 0
    while not stop.is_set():
        count = int(rng.integers(1, MAX_BLOCKS_PER_JOB + 1))
        gpu_ids = rng.choice(args.num_blocks, size=count, replace=False).astype(np.int64)
        cpu_ids = rng.choice(args.num_blocks, size=count, replace=False).astype(np.int64)
        gpu_spec = GPULoadStoreSpec(gpu_ids, [count], [0])
        cpu_spec = CPULoadStoreSpec(cpu_ids)
        for handler, spec in (
            (handlers.store, (gpu_spec, cpu_spec)),
            (handlers.load, (cpu_spec, gpu_spec)),
        ):
            job_id += 1
            handler.transfer_async(job_id, spec)
            handler.wait([job_id])
            handler.get_finished()
        stop.wait(args.pause_seconds)
    handlers.shutdown()
    region.cleanup()


if __name__ == "__main__":
    main()
