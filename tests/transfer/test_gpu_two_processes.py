"""Two processes, one per GPU, attach one region and each stores its own cells; this (third)
process checks the interleaved bytes."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.source_roots import pythonpath

from .helpers import open_region, region_bytes, unpadded
from .two_gpu_worker import worker_data

pytestmark = pytest.mark.gpu

WORKER = Path(__file__).with_name("two_gpu_worker.py")


def test_two_ranks_on_two_gpus_interleave_their_cells() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    num_blocks, block = 32, 256 * 1024
    instance = f"two-{uuid.uuid4().hex[:12]}"
    env = {**os.environ, "PYTHONPATH": pythonpath()}
    with open_region(
        "/dev/shm", unpadded(num_blocks, block, 2), None, instance_id=instance
    ) as region:
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(WORKER),
                    "/dev/shm",
                    instance,
                    str(rank),
                    str(num_blocks),
                    str(block),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        outputs = [w.communicate(timeout=240) for w in workers]
        for worker, (out, err) in zip(workers, outputs, strict=True):
            assert worker.returncode == 0, err
            print(out.strip())
        rows = region_bytes(region)
        for rank in range(2):
            sent = worker_data(rank, num_blocks, block).numpy().view(np.uint8)[::-1]
            assert np.array_equal(rows[:, rank * block : (rank + 1) * block], sent)
