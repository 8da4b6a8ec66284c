"""CPU users never import Triton or the CUDA bindings, and never load the CUDA driver."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys
import numpy as np, torch
from kvshm.transfer import (
    CanonicalKVCacheRef, CPULoadStoreSpec, GPULoadStoreSpec, SingleDirectionOffloadingHandler,
)
gpu = [torch.arange(64, dtype=torch.int8).reshape(4, 16)]
cpu = [torch.zeros((4, 16), dtype=torch.int8)]
h = SingleDirectionOffloadingHandler(gpu, cpu, 1, [[CanonicalKVCacheRef(0, 16)]], True)
h.transfer_async(1, (GPULoadStoreSpec([3], [1], [0]), CPULoadStoreSpec([0])))
h.wait([1])
assert [r.success for r in h.get_finished()] == [True]
assert torch.equal(cpu[0][0], gpu[0][3])
h.shutdown()
loaded = [m for m in sys.modules if m == "triton" or m.startswith(("triton.", "cuda."))]
assert not loaded, loaded
assert "kvshm.transfer.backends.triton_copy" not in sys.modules
import kvshm.transfer.cuda.driver as driver
assert driver._driver is None
print("ok")
"""


def test_cpu_use_imports_no_gpu_module() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
