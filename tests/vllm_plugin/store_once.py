"""A worker process that attaches a region, stores one job with the CPU backend and exits:
its kvshm metrics must reach the parent through PROMETHEUS_MULTIPROC_DIR, as vLLM's /metrics
reads its workers' metrics.

    python -m tests.vllm_plugin.store_once <region dir> <instance id> <blocks> <page> <layers>
"""

from __future__ import annotations

import sys

from kvshm.vllm.attach import attach_region
from kvshm.vllm.geometry import RegionGeometry
from kvshm.vllm.worker import KvshmOffloadingWorker
from tests.vllm_plugin.checks import finish
from tests.vllm_plugin.jobs import Job
from tests.vllm_plugin.layouts import KvLayout, canonical_kv_caches


def main() -> None:
    directory, instance_id = sys.argv[1], sys.argv[2]
    blocks, page, layers = (int(v) for v in sys.argv[3:6])
    geometry = RegionGeometry(blocks, page * layers, page * layers, 1, False)
    region = attach_region(directory, instance_id, geometry, 0, 5.0)
    kv = canonical_kv_caches(KvLayout("metrics", layers, page), blocks, "cpu")
    worker = KvshmOffloadingWorker(
        kv, region, 1, region_dir=directory, instance_id=instance_id, listen_for_drain=False
    )
    job = Job([0, 1, 2], [3, 4, 5], [3], [0])
    worker.submit_store(1, *job.specs())
    assert finish(worker, {1})[1].success
    worker.shutdown()


if __name__ == "__main__":
    main()
