"""Choosing each direction's copy backend from a short measurement on this host, cached per
host and layout (opt-in: kvshm_calibrate).

The measurement runs once, at the worker's first transfer, before that transfer: every backend
the handler could use moves the same jobs between scratch GPU blocks (never the engine's KV
cache) and this worker's own cells of the region, which hold nothing yet (vLLM's CPU tier
starts empty and its first job is a store). The fastest backend per direction is kept in a
JSON file keyed by host (name, GPU, driver) and layout (page sizes, blocks_per_chunk), so later
starts on the host reuse it without measuring.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from kvshm.transfer import CPULoadStoreSpec, GPULoadStoreSpec, SingleDirectionOffloadingHandler

log = logging.getLogger(__name__)

DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvshm"
SCRATCH_BYTES = 64 * 1024 * 1024  # GPU memory the measurement borrows, at most
REPS = 3

HandlerFactory = Callable[
    [bool, str | None, Sequence[torch.Tensor]], SingleDirectionOffloadingHandler
]
"""(gpu_to_cpu, forced backend or None, GPU tensors) -> a handler over this worker's views."""


def host_key(device: torch.device) -> str:
    if device.type != "cuda":
        return f"{socket.gethostname()}/cpu"
    from kvshm.transfer.backends.cuda_driver import cuda_driver

    name = torch.cuda.get_device_name(device).replace(" ", "_")
    return f"{socket.gethostname()}/{name}/driver-{cuda_driver().version}"


def layout_key(pages: Sequence[int], blocks_per_chunk: int) -> str:
    distinct = sorted(set(pages))
    return f"{len(pages)}x{'+'.join(map(str, distinct))}B/bpc{blocks_per_chunk}"


class ChoiceCache:
    """{host: {layout: {"store": backend, "load": backend}}} in one JSON file."""

    def __init__(self, directory: Path = DEFAULT_CACHE) -> None:
        self.path = directory / "backend-choices.json"

    def load(self) -> dict[str, dict[str, dict[str, str]]]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, host: str, layout: str) -> dict[str, str] | None:
        entry = self.load().get(host, {}).get(layout)
        return entry if isinstance(entry, dict) else None

    def put(self, host: str, layout: str, choice: dict[str, str]) -> None:
        data = self.load()
        data.setdefault(host, {})[layout] = choice
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False) as out:
            json.dump(data, out, indent=1)
        os.replace(out.name, self.path)  # another worker's write is replaced whole, not torn


def _scratch(gpu_tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    per_block = sum(t.shape[1] for t in gpu_tensors)
    blocks = max(2, min(64, SCRATCH_BYTES // per_block))
    return [
        torch.empty((blocks, t.shape[1]), dtype=torch.int8, device=t.device) for t in gpu_tensors
    ]


def _time_backend(
    make: HandlerFactory,
    gpu_to_cpu: bool,
    backend: str,
    scratch: Sequence[torch.Tensor],
    num_chunks: int,
    groups: int,
    blocks_per_chunk: int,
) -> float:
    handler = make(gpu_to_cpu, backend, scratch)
    rng = np.random.default_rng(0)
    blocks = min(scratch[0].shape[0], num_chunks * blocks_per_chunk)
    sizes = [blocks] + [0] * (groups - 1)  # the tensors of group 0: enough for the pages
    gpu = GPULoadStoreSpec(rng.permutation(blocks), sizes, [0] * groups)
    chunks = -(-blocks // blocks_per_chunk)
    cpu = CPULoadStoreSpec(rng.choice(num_chunks, chunks, replace=False))
    spec = (gpu, cpu) if gpu_to_cpu else (cpu, gpu)
    best = float("inf")
    try:
        for rep in range(REPS + 1):
            if scratch[0].is_cuda:
                torch.cuda.synchronize(scratch[0].device)
            started = time.perf_counter()
            handler.transfer_async(rep, *spec)
            handler.wait([rep])
            seconds = time.perf_counter() - started
            results = handler.get_finished()
            if not all(r.success for r in results):
                return float("inf")
            if rep:  # the first run warms up (compiles the kernel, maps buffers)
                best = min(best, seconds)
    finally:
        handler.shutdown()
    return best


def choose(
    make: HandlerFactory,
    gpu_tensors: Sequence[torch.Tensor],
    num_chunks: int,
    groups: int,
    blocks_per_chunk: int,
    cache: ChoiceCache,
    measure_stores: bool = True,
) -> dict[str, str]:
    """{"store": backend, "load": backend}: cached for this host and layout, else measured."""
    device = gpu_tensors[0].device
    host = host_key(device)
    layout = layout_key([t.shape[1] for t in gpu_tensors], blocks_per_chunk)
    cached = cache.get(host, layout)
    if cached is not None:
        log.info("kvshm: copy backends for %s on %s (cached): %s", layout, host, cached)
        return cached
    scratch = _scratch(gpu_tensors)
    choice: dict[str, str] = {}
    figures: dict[str, dict[str, float]] = {}
    for name, gpu_to_cpu in (("store", True), ("load", False)):
        if gpu_to_cpu and not measure_stores:
            continue
        probe = make(gpu_to_cpu, None, scratch)
        candidates = probe.backends
        probe.shutdown()
        times = {
            b: _time_backend(make, gpu_to_cpu, b, scratch, num_chunks, groups, blocks_per_chunk)
            for b in candidates
        }
        figures[name] = times
        choice[name] = min(times, key=lambda b: times[b])
    del scratch
    log.info("kvshm: copy backends for %s on %s, measured %s: %s", layout, host, figures, choice)
    if measure_stores:
        cache.put(host, layout, choice)
    return choice
