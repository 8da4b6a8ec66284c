"""choose(): a worker's copy backends, from the cache for this host and layout, else measured
on scratch blocks and cached."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from kvshm.transfer.calibration.cache import ChoiceCache, host_key, layout_key
from kvshm.transfer.calibration.measurement import HandlerFactory, measure
from kvshm.transfer.calibration.policy import measured_backends
from kvshm.transfer.calibration.workload import one_allocation_pitch, scratch_tensors

log = logging.getLogger(__name__)


def choose(
    make: HandlerFactory,
    gpu_tensors: Sequence[torch.Tensor],
    num_chunks: int,
    groups: int,
    blocks_per_chunk: int,
    cache: ChoiceCache,
    measure_stores: bool = True,
    sm_free: bool = False,
) -> dict[str, str]:
    """Measurement.choice(): cached for this host and layout, else measured. sm_free: among
    the backends that leave the SMs to the model only (kvshm_backend: copy-engines)."""
    device = gpu_tensors[0].device
    host = host_key(device)
    pages = [t.shape[1] for t in gpu_tensors]
    one_allocation = one_allocation_pitch(gpu_tensors) is not None
    layout = layout_key(pages, blocks_per_chunk, sm_free, one_allocation)
    cached = cache.get(host, layout, measured_backends(sm_free))
    if cached is not None:
        log.info("kvshm: copy backends for %s on %s (cached): %s", layout, host, cached)
        return cached
    started = time.perf_counter()
    scratch = scratch_tensors(gpu_tensors)
    try:
        measured = measure(
            make, scratch, num_chunks, groups, blocks_per_chunk, measure_stores, sm_free
        )
    finally:
        del scratch
    choice = measured.choice()
    log.info(
        "kvshm: copy backends for %s on %s chosen in %.2f s (%s): %s",
        layout,
        host,
        time.perf_counter() - started,
        measured.summary(),
        choice,
    )
    if measure_stores:
        cache.put(host, layout, choice)
    return choice
