"""GB/s between the GPU and a kvshm region's memory against cudaHostAlloc's, in the same run.

The region is a file on tmpfs, mapped shared and registered with cudaHostRegister, as the vLLM
plugin's worker does; the baseline is torch's pinned memory (cudaHostAlloc). Both move the
same copies between host rows in random order and one device buffer, issued two ways:
  - torch's copy_ (one cudaMemcpyAsync a piece), pieces of 1 GiB down to 256 KiB;
  - kvshm's DMA backend (cuMemcpyBatchAsync): one descriptor a row (rows of a Qwen2.5-7B
    cell, 896 KiB, and of 2 MiB), 8, 16 or 128 descriptors a call.
Each line prints region GB/s, pinned GB/s and their ratio per direction (docs/transfer.md F18).

Run on a GPU machine from the repository root:
    source .gpu/env.sh && python3 bench/transfer/region_memory.py
        [--gib 1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO)]

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench.common.gpu import GIB, KIB, MIB, gbps, median_seconds, wall  # noqa: E402

from kvshm.region import RegionFormat, RegionLayout, SharedOffloadRegion  # noqa: E402
from kvshm.region.shared_region import OpenMode  # noqa: E402
from kvshm.transfer.backends.dma import DmaBackend  # noqa: E402
from kvshm.transfer.cuda.driver import CopyDirection, cuda_driver  # noqa: E402
from kvshm.transfer.jobs.batch import CopyBatch  # noqa: E402

QWEN_CELL = 917504  # Qwen2.5-7B TP1: 28 layers x 32 KiB (K and V) a block
PIECES = (GIB, 8 * MIB, 2 * MIB, 896 * KIB, 256 * KIB)
BATCHES = ((QWEN_CELL, 8), (QWEN_CELL, 16), (QWEN_CELL, 128), (2 * MIB, 16), (2 * MIB, 128))

Issue = Callable[[int, bool], Callable[[], None]]
"""(host address, H2D?) -> a function that queues one pass of the copies."""


class Copies:
    """One pass over `nbytes`: pieces at random host rows, back to back in a device buffer."""

    def __init__(self, nbytes: int, reps: int) -> None:
        self.nbytes = nbytes
        self.reps = reps
        self.device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()

    def order(self, piece: int) -> np.ndarray:
        return np.random.default_rng(piece).permutation(self.nbytes // piece)

    def torch_copies(self, host: torch.Tensor, piece: int) -> Issue:
        def make(_: int, h2d: bool) -> Callable[[], None]:
            def issue() -> None:
                with torch.cuda.stream(self.stream):
                    for i, row in enumerate(self.order(piece)):
                        src = host[row * piece : (row + 1) * piece]
                        dst = self.device[i * piece : (i + 1) * piece]
                        if h2d:
                            dst.copy_(src, non_blocking=True)
                        else:
                            src.copy_(dst, non_blocking=True)

            return issue

        return make

    def batched(self, row: int, per_call: int) -> Issue:
        """kvshm's own DMA backend, one descriptor a row, `per_call` descriptors a call."""
        driver = cuda_driver()

        def make(host: int, h2d: bool) -> Callable[[], None]:
            order = self.order(row)
            batch = CopyBatch.allocate(len(order))
            hosts = host + order * row
            devices = self.device.data_ptr() + np.arange(len(order)) * row
            batch.rows[0], batch.rows[1] = (hosts, devices) if h2d else (devices, hosts)
            batch.rows[2] = row
            batch = batch.with_total(len(order) * row)
            direction = CopyDirection(not h2d, torch.cuda.current_device())
            dma = DmaBackend(driver, direction, descriptors_per_call=per_call)
            if not dma.uses_batch:
                sys.exit("cuMemcpyBatchAsync is missing here (CUDA < 12.8): nothing to compare")

            def issue() -> None:
                dma.copy(batch, self.stream)
                if not dma.uses_batch:
                    sys.exit("the driver refused cuMemcpyBatchAsync on this stream")

            return issue

        return make

    def rate(self, issue: Callable[[], None], moved: int) -> float:
        return gbps(moved, median_seconds(lambda: wall(issue), self.reps, warmup=1))


def measure(copies: Copies, memory: torch.Tensor, pinned: torch.Tensor) -> list[dict[str, object]]:
    nbytes = copies.nbytes
    cases: list[tuple[str, Issue, Issue, int]] = []
    for piece in PIECES:
        name = f"torch copy_, {piece // KIB} KiB pieces"
        region_copies, pinned_copies = (
            copies.torch_copies(memory, piece),
            copies.torch_copies(pinned, piece),
        )
        cases.append((name, region_copies, pinned_copies, nbytes // piece * piece))
    for row, per_call in BATCHES:
        batched = copies.batched(row, per_call)
        name = f"cuMemcpyBatchAsync, {row // KIB} KiB rows, {per_call} a call"
        cases.append((name, batched, batched, nbytes // row * row))
    print(f"{'':52} {'H2D region / pinned':>22} {'D2H region / pinned':>22}")
    rows: list[dict[str, object]] = []
    for name, on_region, on_pinned, moved in cases:
        rates: dict[str, dict[str, float]] = {}
        for direction, h2d in (("H2D", True), ("D2H", False)):
            there = copies.rate(on_region(memory.data_ptr(), h2d), moved)
            base = copies.rate(on_pinned(pinned.data_ptr(), h2d), moved)
            rates[direction] = {"region": there, "pinned": base, "ratio": there / base}
        rows.append({"case": name, "GBps": rates})
        h, d = rates["H2D"], rates["D2H"]
        print(
            f"{name:52} {h['region']:6.1f} / {h['pinned']:5.1f} {h['ratio']:5.2f}x"
            f"     {d['region']:6.1f} / {d['pinned']:5.1f} {d['ratio']:5.2f}x",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes a pass moves, GiB")
    parser.add_argument("--directory", default="/dev/shm", help="tmpfs for the region's file")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/transfer/region_memory.py needs a CUDA device")
    nbytes = int(args.gib * GIB) // (2 * MIB) * (2 * MIB)
    copies = Copies(nbytes, args.reps)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(7)
    layout = RegionLayout(nbytes // (2 * MIB), 2 * MIB, 1, RegionFormat.VLLM_0_33)
    region = SharedOffloadRegion(
        f"kvshm-bench-memory-{uuid.uuid4().hex[:8]}",
        layout,
        directory=args.directory,
        mode=OpenMode.CREATE,
        populate=True,
    )
    print(f"device: {torch.cuda.get_device_name()}; {nbytes / GIB:.2f} GiB a pass")
    try:
        if not region.pin(cells_only=False):
            sys.exit("the region could not be registered with CUDA (see the warning above)")
        rows = measure(copies, region._base_tensor()[:nbytes], pinned)
    finally:
        region.cleanup()  # no view of it is left: measure's are gone
    if args.json:
        Path(args.json).write_text(json.dumps({"bytes": nbytes, "cases": rows}, indent=2))


if __name__ == "__main__":
    main()
