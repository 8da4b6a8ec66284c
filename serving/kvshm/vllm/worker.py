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
from kvshm.transfer import (
    BackendName,
    BackendPolicy,
    ChoiceCache,
    HandlerAssembly,
    HandlerLayout,
    SingleDirectionOffloadingHandler,
    WorkerHandlers,
)
from kvshm.vllm.background_pin import BackgroundPin
from kvshm.vllm.events import DrainListener
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
        self.gpu_tensors = [
            t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors
        ]
        layout = HandlerLayout.over_region(
            self.gpu_tensors, region, blocks_per_chunk, kv_caches.group_data_refs
        )
        self.cpu_tensors = layout.cpu_tensors  # the layout's own list, emptied on release
        self._assembly = HandlerAssembly(layout, backend, calibration, measure_stores=stores)
        device = self.gpu_tensors[0].device
        self._pin = BackgroundPin(region, device) if pin and device.type == "cuda" else None
        hint = block_outer_hint([t.page_size_bytes for t in kv_caches.tensors])
        if (
            hint is not None
            and device.type == "cuda"
            and self._assembly.forced in (None, BackendName.STAGED)
        ):
            log.info(hint)
        self._handlers: WorkerHandlers | None = None
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

    # -- handlers ------------------------------------------------------------------------

    def _ready(self) -> WorkerHandlers:
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
            self._handlers = self._assembly.build()
        return self._handlers

    @property
    def pin(self) -> BackgroundPin | None:
        return self._pin

    @property
    def drain_listener(self) -> DrainListener | None:
        return self._listener

    @property
    def chosen_backends(self) -> dict[str, str]:
        """The calibration's choice (after the first transfer; {} where none was made)."""
        return self._assembly.chosen_backends

    @property
    def calibration_seconds(self) -> float | None:
        """How long the first transfer spent choosing the backends (0 s-ish when cached)."""
        return self._assembly.calibration_seconds

    def handler_backends(self) -> dict[str, list[str]]:
        """The copy backends each handler may choose from (after the first transfer)."""
        return {} if self._handlers is None else self._handlers.backends()

    # -- vLLM 0.33's OffloadingWorker ----------------------------------------------------

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        with self._lock:
            return self._ready().store.transfer_async(job_id, src_spec, dst_spec)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        with self._lock:
            handlers = self._ready()
            handler = handlers.expedited_load if expedited else handlers.load
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
            handlers: Sequence[SingleDirectionOffloadingHandler] = self._handlers or []
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
