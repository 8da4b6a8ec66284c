"""A worker's transfer handlers, assembled in one place: a store, a load and an expedited load
handler over one layout of tensors, and which copy backends each of them gets.

A handler's backends come from the first of: the calibration's measurement for its direction
(one backend for jobs while the other direction is idle, another while it is busy: the
handlers share a Traffic), the backend forced for every job, the choice per job by block size.
Under copy-engines, without a measurement, a handler takes the first of SM_FREE_BACKENDS it
can build. The vLLM plugin's worker, bench/transfer and the tests build their handlers here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvshm.region import SharedOffloadRegion
from kvshm.transfer.calibration import ChoiceCache, choose
from kvshm.transfer.choice.chooser import COPY_ENGINES, SM_FREE_BACKENDS, BackendPolicy
from kvshm.transfer.choice.traffic import Traffic
from kvshm.transfer.errors import BackendUnavailableError
from kvshm.transfer.handler import SingleDirectionOffloadingHandler
from kvshm.transfer.jobs.specs import CanonicalKVCacheRef
from kvshm.transfer.jobs.tensors import check_gpu_tensors
from kvshm.transfer.options import TransferOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HandlerLayout:
    """What a worker's handlers move blocks between: its GPU KV tensors (int8, one page a row),
    its CPU views of the region (blocks_per_chunk pages a row, one per GPU tensor, in order)
    and, per KV-cache group, the tensors the group copies (vLLM 0.33's arguments)."""

    gpu_tensors: Sequence[torch.Tensor]
    cpu_tensors: list[torch.Tensor]
    blocks_per_chunk: int
    group_refs: Sequence[Sequence[CanonicalKVCacheRef]]

    @classmethod
    def over_region(
        cls,
        gpu_tensors: Sequence[torch.Tensor],
        region: SharedOffloadRegion,
        blocks_per_chunk: int,
        group_refs: Sequence[Sequence[CanonicalKVCacheRef]],
    ) -> HandlerLayout:
        """This worker's views of the region for these GPU tensors: one create_next_view per
        tensor, of its page x blocks_per_chunk bytes, in order."""
        check_gpu_tensors(gpu_tensors)
        views = [region.create_next_view(t.shape[1] * blocks_per_chunk) for t in gpu_tensors]
        return cls(gpu_tensors, views, blocks_per_chunk, group_refs)

    @property
    def num_chunks(self) -> int:
        """The region's blocks: the rows of every CPU view."""
        return int(self.cpu_tensors[0].shape[0])

    def handler(
        self,
        gpu_to_cpu: bool,
        backend: str | None = None,
        gpu_tensors: Sequence[torch.Tensor] | None = None,
        *,
        beside: str | None = None,
        traffic: Traffic | None = None,
        options: TransferOptions | None = None,
        policy: BackendPolicy | None = None,
    ) -> SingleDirectionOffloadingHandler:
        """One direction's handler over these tensors (gpu_tensors: others of the same shapes
        instead, the calibration's scratch blocks). backend: every job's (None: chosen per
        job by block size); with beside and traffic, backend for jobs while the other
        direction is idle and beside while it is busy."""
        return SingleDirectionOffloadingHandler(
            self.gpu_tensors if gpu_tensors is None else gpu_tensors,
            self.cpu_tensors,
            self.blocks_per_chunk,
            self.group_refs,
            gpu_to_cpu,
            backend=backend,
            options=options,
            policy=policy,
            backend_beside=beside,
            traffic=traffic,
        )


class WorkerHandlers(NamedTuple):
    """A worker's handlers by name; the expedited loads have a handler, and so a stream, of
    their own: they must not queue behind the loads."""

    store: SingleDirectionOffloadingHandler
    load: SingleDirectionOffloadingHandler
    expedited_load: SingleDirectionOffloadingHandler

    def backends(self) -> dict[str, list[str]]:
        """The copy backends each handler may choose from, by the handler's name."""
        return {name: handler.backends for name, handler in self._asdict().items()}

    def shutdown(self) -> None:
        """Wait for and release every handler; the region stays the caller's."""
        for handler in self:
            handler.shutdown()


class HandlerAssembly:
    """Builds a worker's handlers over one layout, at its first transfer (build()).

    backend: None (measured with `calibration` if given, else chosen per job by block size),
    a backend's name (every job's, nothing measured), or COPY_ENGINES (measured among
    SM_FREE_BACKENDS, else the first of them a handler can build). measure_stores: False for a
    worker that never stores (vLLM's replicated layout, ranks other than 0), which then
    measures loads only."""

    def __init__(
        self,
        layout: HandlerLayout,
        backend: str | None = None,
        calibration: ChoiceCache | None = None,
        *,
        measure_stores: bool = True,
    ) -> None:
        self.layout = layout
        self._sm_free = backend == COPY_ENGINES
        self.forced = None if self._sm_free else backend
        """The backend every job gets, or None where it is measured or chosen per job."""
        self._calibration = calibration if self.forced is None else None
        self._measure_stores = measure_stores
        self.chosen_backends: dict[str, str] = {}
        """The calibration's choice (policy.CHOICES), once build() measured or read it."""
        self.calibration_seconds: float | None = None
        """How long build() spent choosing the backends (0 s-ish when cached)."""

    def build(self) -> WorkerHandlers:
        if self._calibration is not None:
            self.chosen_backends = self._calibrate(self._calibration)
        traffic = Traffic()  # which backend a job gets may depend on the other direction
        store = self._handler(True, traffic)
        return WorkerHandlers(store, self._handler(False, traffic), self._handler(False, traffic))

    def _handler(self, gpu_to_cpu: bool, traffic: Traffic) -> SingleDirectionOffloadingHandler:
        name = "store" if gpu_to_cpu else "load"
        backend = self.chosen_backends.get(name)
        if backend is not None:
            beside = self.chosen_backends.get(f"{name}_beside")
            try:
                return self.layout.handler(gpu_to_cpu, backend, beside=beside, traffic=traffic)
            except BackendUnavailableError:
                # a measured backend this handler cannot build (its staging buffers no longer
                # fit the GPU, say): the unmeasured choice instead
                log.warning("kvshm: the measured %s backends cannot be built", name)
        return self._unmeasured_handler(gpu_to_cpu)

    def _calibrate(self, cache: ChoiceCache) -> dict[str, str]:
        started = time.perf_counter()
        layout = self.layout
        try:
            return choose(
                layout.handler,
                layout.gpu_tensors,
                layout.num_chunks,
                len(layout.group_refs),
                layout.blocks_per_chunk,
                cache,
                measure_stores=self._measure_stores,
                sm_free=self._sm_free,
            )
        except Exception:
            # a measurement that cannot run (no GPU memory left for its scratch blocks, say)
            # must not stop the engine: the handlers then choose per job by the block size
            log.warning(
                "kvshm: could not measure the copy backends; choosing them by block size",
                exc_info=True,
            )
            return {}
        finally:
            self.calibration_seconds = time.perf_counter() - started

    def _unmeasured_handler(self, gpu_to_cpu: bool) -> SingleDirectionOffloadingHandler:
        """A handler with no measurement to go by: the forced backend, or the choice per job
        by block size; under copy-engines the strided backend where the KV cache allows it
        (one 2-D copy a block, fewer calls than DMA's one a page), else DMA (CPU tensors:
        memmove)."""
        if not self._sm_free:
            return self.layout.handler(gpu_to_cpu, self.forced)
        refused: list[str] = []
        for name in SM_FREE_BACKENDS:
            try:
                handler = self.layout.handler(gpu_to_cpu, name)
            except BackendUnavailableError as exc:
                refused.append(str(exc))
                continue
            if refused:
                log.info("kvshm: copy-engines takes %s: %s", name, "; ".join(refused))
            return handler
        raise BackendUnavailableError(f"no copy backend without SMs: {'; '.join(refused)}")
