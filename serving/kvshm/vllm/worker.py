"""KvshmOffloadingWorker: vLLM 0.33's OffloadingWorker over the agent's region, with kvshm's
transfer handlers (one for stores, one for loads, one for expedited loads)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from functools import partial

import torch

from kvshm.region import SharedOffloadRegion
from kvshm.region.drain_event import DrainEvent
from kvshm.transfer import BackendUnavailableError, SingleDirectionOffloadingHandler
from kvshm.transfer.backends.base import BackendName
from kvshm.transfer.calibration import ChoiceCache, choose
from kvshm.transfer.choice.chooser import COPY_ENGINES, SM_FREE_BACKENDS, BackendPolicy
from kvshm.transfer.choice.traffic import Traffic
from kvshm.vllm.events import DrainListener
from kvshm.vllm.pinning import BackgroundPin
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

log = logging.getLogger(__name__)

# block-outer strides that an H100 80GB (five HBM stacks) reads slower, an H200 not
# (docs/vllm-plugin.md, block-outer KV caches)
ALIASED_STRIDE_BYTES = 5 * 64 * 1024


def block_outer_hint(page_sizes: Sequence[int]) -> str | None:
    """Advice for a layer-outer KV cache whose pages kvshm would stage through GPU memory, or
    None. Staging gathers them with a copy kernel, which delays the engine's matrix products;
    a block-outer cache gives one page per block, which the copy engines move at the link's
    speed with no SMs, but where a block (the block-outer stride of every layer's page) is a
    multiple of ALIASED_STRIDE_BYTES an H100's attention decodes slower (docs/vllm-plugin.md)."""
    smallest = min(page_sizes, default=0)
    if len(page_sizes) < 2 or smallest >= BackendPolicy().staged_below_copy_bytes:
        return None
    block = sum(page_sizes)
    if block % ALIASED_STRIDE_BYTES == 0:
        reads = (
            f"; but at {block // 1024} KiB a block, a multiple of {ALIASED_STRIDE_BYTES // 1024} "
            f"KiB, an H100 80GB decodes up to 18 % slower that way (an H200 does not)"
        )
    else:
        reads = " and vLLM's FlashAttention decodes it as fast on H100s and H200s"
    return (
        f"kvshm: {len(page_sizes)} KV tensors of {smallest // 1024} KiB pages are staged through "
        f"GPU memory by a copy kernel, taking SM time from the model; with "
        f"VLLM_KV_CACHE_LAYOUT=BLHNC a block is one page the copy engines move without "
        f"SMs{reads}; kvshm_backend: copy-engines keeps the cache and the SMs free at less of "
        f"the link (docs/vllm-plugin.md)"
    )


class RegionDrainedError(RuntimeError):
    """The agent drained the region: this engine can no longer offload to it."""


class KvshmOffloadingWorker(OffloadingWorker):
    """Stores, loads and expedited loads between the GPU KV cache and this worker's cells.

    The CPU side is one view of the region per canonical KV tensor, of that tensor's page x
    blocks_per_chunk bytes, back to back in the worker's cell (vLLM's own layout). Handlers are
    built at the first transfer, after the background CUDA registration finished, so the
    copy kernel may read the registered region.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        region: SharedOffloadRegion,
        blocks_per_chunk: int,
        *,
        region_dir: str,
        instance_id: str,
        pin: bool = True,
        backend: str | None = None,
        listen_for_drain: bool = True,
        calibration: ChoiceCache | None = None,
        stores: bool = True,
    ) -> None:
        """calibration: measure (or read from that cache) each direction's backend at the first
        transfer, unless `backend` forces one; backend copy-engines measures only those that
        leave the SMs to the model, and without a measurement takes strided, else dma.
        stores: False for a rank that never stores (vLLM's replicated layout, ranks other than
        0), which then measures loads only."""
        started = time.perf_counter()
        self.region = region
        self.instance_id = instance_id
        self.blocks_per_chunk = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._sm_free = backend == COPY_ENGINES
        self._backend = None if self._sm_free else backend
        self._calibration = calibration if self._backend is None else None
        self._stores = stores
        self.num_chunks = region.layout.num_blocks
        self.chosen_backends: dict[str, str] = {}
        self.gpu_tensors = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors
        ]
        self.cpu_tensors = [
            region.create_next_view(t.page_size_bytes * blocks_per_chunk) for t in kv_caches.tensors
        ]
        device = self.gpu_tensors[0].device
        self._pin = BackgroundPin(region, device) if pin and device.type == "cuda" else None
        hint = block_outer_hint([t.page_size_bytes for t in kv_caches.tensors])
        if (
            hint is not None
            and device.type == "cuda"
            and self._backend in (None, BackendName.STAGED)
        ):
            log.info(hint)
        self._handlers: list[SingleDirectionOffloadingHandler] | None = None
        self._lock = threading.Lock()
        self._drain: DrainEvent | None = None
        self._drained_results: list[TransferResult] = []
        self._closed = False
        self._listener = (
            DrainListener(region_dir, instance_id, self._on_drain) if listen_for_drain else None
        )
        self.create_seconds = time.perf_counter() - started
        """How long building the worker blocked the engine (registration runs on after it)."""
        self.first_transfer_wait_seconds: float | None = None
        """How long the first transfer waited for the CUDA registration to finish."""
        self.calibration_seconds: float | None = None
        """How long the first transfer spent choosing the backends (0 s-ish when cached)."""

    # -- handlers ------------------------------------------------------------------------

    def _ready(self) -> list[SingleDirectionOffloadingHandler]:
        if self._drain is not None:
            raise RegionDrainedError(
                f"the kvshm agent drained region {self._drain.region} (instance "
                f"{self.instance_id}): {self._drain.reason or 'no reason given'}. vLLM 0.33 "
                f"cannot drop its CPU offload tier while running, so this engine must be "
                f"restarted; it attaches again once the region is Ready."
            )
        if self._closed:
            raise RegionDrainedError(f"the kvshm worker of {self.instance_id} was shut down")
        if self._handlers is None:
            if self._pin is not None:
                self._pin.wait()
                self.first_transfer_wait_seconds = self._pin.wait_seconds
                log.info(
                    "kvshm: first transfer waited %.3f s for the region's CUDA registration",
                    self.first_transfer_wait_seconds,
                )

            if self._calibration is not None:
                self.chosen_backends = self._calibrate(self._calibration)

            traffic = Traffic()  # which backend a job gets may depend on the other direction

            def handler(gpu_to_cpu: bool) -> SingleDirectionOffloadingHandler:
                name = "store" if gpu_to_cpu else "load"
                backend = self.chosen_backends.get(name)
                if backend is not None:
                    beside = self.chosen_backends.get(f"{name}_beside")
                    try:
                        return self._make_handler(
                            gpu_to_cpu, backend, self.gpu_tensors, beside=beside, traffic=traffic
                        )
                    except BackendUnavailableError:
                        # a measured backend this handler cannot build (its staging buffers
                        # no longer fit the GPU, say): the unmeasured choice instead
                        log.warning("kvshm: the measured %s backends cannot be built", name)
                return self._unmeasured_handler(gpu_to_cpu)

            # store, load, and expedited load on its own stream: it must not queue behind loads
            self._handlers = [handler(True), handler(False), handler(False)]
        return self._handlers

    def _calibrate(self, cache: ChoiceCache) -> dict[str, str]:
        started = time.perf_counter()
        try:
            return choose(
                self._make_handler,
                self.gpu_tensors,
                self.num_chunks,
                len(self._refs),
                self.blocks_per_chunk,
                cache,
                measure_stores=self._stores,
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
            return self._make_handler(gpu_to_cpu, self._backend, self.gpu_tensors)
        refused: list[str] = []
        for name in SM_FREE_BACKENDS:
            try:
                handler = self._make_handler(gpu_to_cpu, name, self.gpu_tensors)
            except BackendUnavailableError as exc:
                refused.append(str(exc))
                continue
            if refused:
                log.info("kvshm: copy-engines takes %s: %s", name, "; ".join(refused))
            return handler
        raise BackendUnavailableError(f"no copy backend without SMs: {'; '.join(refused)}")

    def _make_handler(
        self,
        gpu_to_cpu: bool,
        backend: str | None,
        gpu_tensors: Sequence[torch.Tensor],
        *,
        beside: str | None = None,
        traffic: Traffic | None = None,
    ) -> SingleDirectionOffloadingHandler:
        """backend: every job's (None: by block size); with beside and traffic, backend for
        jobs while the other direction is idle and beside while it is busy."""
        return SingleDirectionOffloadingHandler(
            gpu_tensors,
            self.cpu_tensors,
            self.blocks_per_chunk,
            self._refs,
            gpu_to_cpu,
            backend=backend,
            backend_beside=beside,
            traffic=traffic,
        )

    @property
    def pin(self) -> BackgroundPin | None:
        return self._pin

    @property
    def drain_listener(self) -> DrainListener | None:
        return self._listener

    def handler_backends(self) -> dict[str, list[str]]:
        """The copy backends each handler may choose from (after the first transfer)."""
        names = ("store", "load", "expedited_load")
        return {n: h.backends for n, h in zip(names, self._handlers or [], strict=False)}

    # -- vLLM 0.33's OffloadingWorker ----------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        with self._lock:
            return self._ready()[0].transfer_async(job_id, src_spec, dst_spec)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        with self._lock:
            handler = self._ready()[2 if expedited else 1]
            return handler.transfer_async(job_id, src_spec, dst_spec)

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            results, self._drained_results = self._drained_results, []
            for handler in self._handlers or []:
                results.extend(self._as_vllm(handler.get_finished()))
            return results

    @staticmethod
    def _as_vllm(results: Iterable[object]) -> list[TransferResult]:
        return [
            TransferResult(
                job_id=r.job_id,  # type: ignore[attr-defined]
                success=r.success,  # type: ignore[attr-defined]
                transfer_size=r.transfer_size,  # type: ignore[attr-defined]
                transfer_time=r.transfer_time,  # type: ignore[attr-defined]
            )
            for r in results
        ]

    def wait(self, job_ids: set[int]) -> None:
        """While one handler's wait blocks, the others' finished jobs are retired: both ways
        at once, the loads' bookkeeping then overlaps the stores' copies instead of following
        the wait in get_finished."""
        with self._lock:
            handlers = self._handlers or []
            for handler in handlers:
                others = [h for h in handlers if h is not handler]
                handler.wait(job_ids, partial(_retire_finished, others))

    def shutdown(self) -> None:
        """Finish every job in flight, then release the region (the file stays). Idempotent."""
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            self._release()

    # -- draining ------------------------------------------------------------------------

    def _on_drain(self, event: DrainEvent) -> None:
        """The agent is taking the region away: stop taking jobs, finish those in flight (their
        results still reach vLLM), and release the region so the agent sees no holder."""
        log.warning(
            "kvshm: region %s is being drained (%s); finishing %s and releasing it before %s",
            event.region,
            event.reason,
            "the transfers in flight",
            time.strftime("%H:%M:%S", time.gmtime(event.deadline)),
        )
        with self._lock, self._on_worker_device():
            self._drain = event
            for handler in self._handlers or []:
                handler.wait_all()
                self._drained_results.extend(self._as_vllm(handler.get_finished()))
            self._release()

    def _on_worker_device(self) -> AbstractContextManager[object]:
        """This thread's CUDA calls on the worker's GPU: on another device the runtime would
        create a context there, and the region's unregistration belongs to this one."""
        device = self.gpu_tensors[0].device
        return torch.cuda.device(device) if device.type == "cuda" else nullcontext()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        for handler in self._handlers or []:
            handler.shutdown()
        self._handlers = None  # their CPU views must go before the region is unmapped
        if self._pin is not None:
            self._pin.wait_quietly()
        self.cpu_tensors.clear()
        self.region.cleanup()

    @property
    def drained(self) -> DrainEvent | None:
        return self._drain


def _retire_finished(handlers: Iterable[SingleDirectionOffloadingHandler]) -> None:
    for handler in handlers:
        handler.retire_finished()
