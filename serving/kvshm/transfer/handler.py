"""SingleDirectionOffloadingHandler: vLLM 0.33's in-order transfer handler for one direction.

Its constructor and transfer_async take vLLM 0.33's arguments (blocks_per_chunk,
layer_refs_per_group, transfer_async(job_id, src_spec, dst_spec)) and vLLM's own spec objects;
the 0.20-style transfer_async(job_id, (src_spec, dst_spec)) is still accepted.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvshm.transfer.choice.chooser import BackendChooser, BackendPolicy, override_from_env
from kvshm.transfer.choice.routing import JobRouter
from kvshm.transfer.choice.traffic import Traffic
from kvshm.transfer.errors import (
    HandlerClosedError,
    InvalidTensorsError,
    InvalidTransferSpecError,
)
from kvshm.transfer.jobs.plan import JobPlanner
from kvshm.transfer.jobs.specs import (
    CPU_MEDIUM,
    GPU_MEDIUM,
    CanonicalKVCacheRef,
    TransferResult,
    TransferSpec,
)
from kvshm.transfer.jobs.tensors import check_group_refs, check_tensors
from kvshm.transfer.jobs.uniform import UniformLayout
from kvshm.transfer.metrics import Direction, FinishedJob, TransferMetrics
from kvshm.transfer.options import TransferOptions
from kvshm.transfer.ordering.timeline import CpuTimeline, Ticket, Timeline

log = logging.getLogger(__name__)


@dataclass
class _Job:
    job_id: int
    ticket: Ticket
    size_bytes: int
    backend: str


def _timeline_for(device: torch.device, options: TransferOptions) -> Timeline:
    """Where the jobs run: the caller's thread on CUDA streams, or a thread of the CPU's."""
    if device.type == "cpu":
        return CpuTimeline()
    from kvshm.transfer.ordering.cuda_timeline import CudaTimeline

    return CudaTimeline(device, options.stream_per_job)


class SingleDirectionOffloadingHandler:
    """Moves KV blocks one way (GPU->CPU or CPU->GPU) between matching tensor lists.

    Jobs run in submission order, each after the previous one finished; every job also waits
    for the work queued on the caller's current stream at submission (as in vLLM 0.33). With
    CPU tensors as the "GPU" tensors the handler runs on the CPU backend (for tests without a
    GPU).

    backend forces one backend ("dma", "kernel", "staged", "strided" or "cpu"; default:
    $KVSHM_TRANSFER_BACKEND, else chosen per job by block size and direction).

    The arguments are vLLM 0.33's: a CPU tensor's block holds blocks_per_chunk GPU blocks, and
    layer_refs_per_group lists per KV-cache group the (tensor_idx, page_size_bytes) it copies
    (vLLM's CanonicalKVCacheRef or kvshm's). canonical_layout (vLLM's per-layer canonical host
    pages) is refused; host_memory_is_pinned is accepted for vLLM's signature only: kvshm
    checks the CPU tensors' registration itself.
    """

    def __init__(
        self,
        gpu_tensors: Sequence[torch.Tensor],
        cpu_tensors: Sequence[torch.Tensor],
        blocks_per_chunk: int,
        layer_refs_per_group: Sequence[Sequence[CanonicalKVCacheRef]],
        gpu_to_cpu: bool,
        canonical_layout: bool = False,
        host_memory_is_pinned: bool = True,
        *,
        backend: str | None = None,
        options: TransferOptions | None = None,
        policy: BackendPolicy | None = None,
        backend_beside: str | None = None,
        traffic: Traffic | None = None,
    ) -> None:
        if canonical_layout:
            raise InvalidTensorsError(
                "kvshm copies whole pages per worker (vLLM's direct layout); vLLM's "
                "canonical_layout is not supported: remove canonical_layout from "
                "kv_connector_extra_config"
            )
        block_size_factor = blocks_per_chunk
        pairs = check_tensors(gpu_tensors, cpu_tensors, block_size_factor)
        # the planner works with addresses: these references keep the memory behind them alive
        self.gpu_tensors = list(gpu_tensors)
        self.cpu_tensors = list(cpu_tensors)
        self.blocks_per_chunk = block_size_factor
        self.kv_cache_groups_data_refs = check_group_refs(layer_refs_per_group, pairs)
        self.gpu_to_cpu = bool(gpu_to_cpu)
        self.direction = Direction.GPU_TO_CPU if self.gpu_to_cpu else Direction.CPU_TO_GPU
        self.transfer_type = (GPU_MEDIUM, CPU_MEDIUM) if gpu_to_cpu else (CPU_MEDIUM, GPU_MEDIUM)
        self.device = pairs.device
        self._planner = JobPlanner(
            pairs.gpu, pairs.cpu, block_size_factor, self.kv_cache_groups_data_refs, gpu_to_cpu
        )
        options = options or TransferOptions()
        policy = policy or BackendPolicy()
        override = backend if backend is not None else override_from_env()
        # a backend for jobs while the other direction is busy, another for the rest: both are
        # built and picked by name per job (traffic says which case holds)
        self._traffic = traffic if backend_beside not in (None, override) else None
        self._named = (override, backend_beside) if self._traffic is not None else None
        layout = UniformLayout.of(
            pairs.gpu, pairs.cpu, block_size_factor, self.kv_cache_groups_data_refs
        )
        self._chooser = BackendChooser.for_handler(
            pairs,
            self.kv_cache_groups_data_refs,
            self.direction,
            options,
            policy,
            layout,
            override,
            self._named,
        )
        self._router = JobRouter(self._chooser, self._planner, layout, self.gpu_to_cpu)
        self._timeline = _timeline_for(pairs.device, options)
        self._metrics = TransferMetrics(self.direction)
        self._jobs: deque[_Job] = deque()
        self._pending: dict[int, _Job] = {}
        self._ready: list[TransferResult] = []  # retired by wait, for get_finished
        self._closed = False

    @property
    def backends(self) -> list[str]:
        """Names of the backends this handler may choose from."""
        return self._chooser.names

    def transfer_async(self, job_id: int, src_spec: object, dst_spec: object | None = None) -> bool:
        """Queue a job and return True; a copy that fails later is reported by get_finished
        as success=False. A spec that does not describe a valid transfer raises
        InvalidTransferSpecError and queues nothing.

        vLLM 0.33 calls transfer_async(job_id, src_spec, dst_spec); the 0.20 form
        transfer_async(job_id, (src_spec, dst_spec)) is the same job."""
        spec: TransferSpec | object = src_spec if dst_spec is None else (src_spec, dst_spec)
        if self._closed:
            raise HandlerClosedError(f"job {job_id}: the handler was shut down")
        if job_id in self._pending:
            raise InvalidTransferSpecError(
                f"job {job_id} is still in flight: job ids must be unique until finished"
            )
        # a store must follow the compute that wrote its blocks; a load must follow writes
        # queued to its destination blocks (vLLM 0.33 zeroes freshly allocated blocks on the
        # compute stream, and with async scheduling nothing else orders that before the load)
        after = self._timeline.caller_stream()
        route = self._router.route(self._backend_name(), spec, after)
        ticket = self._timeline.launch(route.work, after)
        job = _Job(job_id, ticket, route.size_bytes, route.backend.name)
        self._jobs.append(job)
        self._pending[job_id] = job
        if self._traffic is not None:
            self._traffic.started(self.direction)
        return True

    def backend_for(self, src_spec: object, dst_spec: object) -> str:
        """The backend this handler would give the job now (nothing is issued)."""
        return self._router.backend_for(self._backend_name(), (src_spec, dst_spec))

    def _backend_name(self) -> str | None:
        """The backend named for this job, or None where the chooser picks by the job."""
        if self._named is None:
            return None  # an override, if any, is the chooser's
        alone, beside = self._named
        assert self._traffic is not None
        return beside if self._traffic.other_busy(self.direction) else alone

    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs finished since the last call, in submission order."""
        results, self._ready = self._ready, []
        self._collect(results)
        return results

    def _collect(self, into: list[TransferResult], stop: _Job | None = None) -> None:
        """Retire the done jobs at the head of the queue (up to, not including, stop)."""
        done = []
        while self._jobs and self._jobs[0] is not stop and self._jobs[0].ticket.done():
            done.append(self._jobs.popleft())
        if done:
            into.extend(self._retire(done))

    def _retire(self, jobs: list[_Job]) -> list[TransferResult]:
        """Release done jobs and report them; the metrics and the traffic count move once for
        all of them."""
        results = []
        finished: list[FinishedJob] = []
        for job in jobs:
            ticket = job.ticket
            seconds = ticket.seconds()
            self._timeline.release(ticket)
            del self._pending[job.job_id]
            success = ticket.error is None
            if success:
                finished.append((job.size_bytes, seconds, job.backend))
            else:
                log.error("transfer job %d failed: %s", job.job_id, ticket.error)
            results.append(
                TransferResult(job.job_id, success, job.size_bytes, seconds, self.transfer_type)
            )
        self._metrics.finished(finished)
        if len(finished) < len(jobs):
            self._metrics.failed(len(jobs) - len(finished))
        if self._traffic is not None:
            self._traffic.finished(self.direction, len(jobs))
        return results

    def wait(self, job_ids: Iterable[int], meanwhile: Callable[[], object] | None = None) -> None:
        """Block until the given jobs are done (ids not in flight are ignored). Jobs end in
        submission order, so this waits for the latest of them; the jobs ahead of it are
        retired as they end, their bookkeeping overlapping the copies still running rather
        than following the wait in get_finished, which returns them. meanwhile, if given, is
        called before each block (a worker retires its other handlers' finished jobs so)."""
        wanted = job_ids if isinstance(job_ids, (set, frozenset, dict)) else set(job_ids)
        target = next((job for job in reversed(self._jobs) if job.job_id in wanted), None)
        if target is None:
            return
        while not target.ticket.done():
            if meanwhile is not None:
                meanwhile()
            if self._jobs[0] is target:
                break
            self._jobs[0].ticket.synchronize()
            self._collect(self._ready, stop=target)
        target.ticket.synchronize()

    def retire_finished(self) -> None:
        """Retire the jobs that have ended, keeping their results for get_finished (what wait
        does while it blocks)."""
        self._collect(self._ready)

    def wait_all(self) -> None:
        """Block until every job in flight is done; their results stay for get_finished."""
        if self._jobs:
            self._jobs[-1].ticket.synchronize()  # the last to end

    def shutdown(self) -> None:
        """Wait for every job and release streams, events and threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.wait_all()
        self._retire(list(self._jobs))
        self._jobs.clear()
        self._timeline.close()
        staged = self._chooser.staged()
        if staged is not None:
            staged.close()
