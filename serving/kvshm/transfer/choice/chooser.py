"""Choosing a copy backend per job, by the job's block size and direction, with an override."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvshm.transfer.backends.base import BackendName, CopyBackend
from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.backends.factory import build_backends
from kvshm.transfer.backends.staged import StagedBackend
from kvshm.transfer.errors import BackendUnavailableError
from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.pointers import RowGeometry
from kvshm.transfer.jobs.specs import CanonicalKVCacheRef
from kvshm.transfer.jobs.staging import layout_run_bytes
from kvshm.transfer.jobs.tensors import TensorPairs
from kvshm.transfer.jobs.uniform import UniformLayout
from kvshm.transfer.metrics import Direction
from kvshm.transfer.options import TransferOptions

log = logging.getLogger(__name__)

BACKEND_ENV = "KVSHM_TRANSFER_BACKEND"
BACKEND_NAMES = tuple(BackendName)
COPY_ENGINES = "copy-engines"
"""Not a backend but a choice among those that leave the SMs to the model (SM_FREE_BACKENDS)."""
SM_FREE_BACKENDS = (BackendName.STRIDED, BackendName.DMA, BackendName.CPU)
"""In the order taken where none was measured: a 2-D copy a block where the layout allows."""


def _default_kernel_below() -> dict[Direction, int]:
    # under 64 KiB the copy engines are bound by the driver's time per descriptor and the
    # kernel moves more; from 64 KiB the engines keep up, and only they overlap both
    # directions (docs/transfer.md)
    return {Direction.CPU_TO_GPU: 64 * 1024, Direction.GPU_TO_CPU: 64 * 1024}


@dataclass(frozen=True)
class BackendPolicy:
    """Stage a job whose copies average fewer than staged_below_copy_bytes and whose host
    side forms runs of staged_from_run_bytes or more on average (at most half as many runs as
    copies); otherwise use the copy kernel for jobs whose copies average fewer bytes than the
    direction's threshold, the copy engines for the rest."""

    kernel_below_bytes: Mapping[Direction, int] = field(default_factory=_default_kernel_below)
    staged_from_run_bytes: int = 256 * 1024
    # many small pages: both directions at once DMA is bound by one thread issuing every
    # page's descriptor, where staging issues one a block; from 128 KiB the descriptors are
    # few enough (docs/transfer.md)
    staged_below_copy_bytes: int = 128 * 1024


def why_not_staged(
    cpu: Sequence[RowGeometry],
    group_refs: Sequence[Sequence[CanonicalKVCacheRef]],
    policy: BackendPolicy,
) -> str | None:
    """Why no job of this layout could be staged under the policy, or None if some could (its
    buffers are then reserved with the handler)."""
    runs = layout_run_bytes(cpu, group_refs)
    if runs < policy.staged_from_run_bytes:
        return (
            f"a CPU block gives runs of at most {runs} bytes, below the policy's "
            f"{policy.staged_from_run_bytes}"
        )
    smallest = min(ref.page_size_bytes for refs in group_refs for ref in refs)
    if smallest >= policy.staged_below_copy_bytes:
        return (
            f"the pages ({smallest} bytes or more) reach the link by DMA as they are (the "
            f"policy stages copies under {policy.staged_below_copy_bytes} bytes)"
        )
    return None


def override_from_env() -> str | None:
    value = os.environ.get(BACKEND_ENV, "").strip().lower()
    if not value or value == "auto":
        return None
    if value not in BACKEND_NAMES:
        raise BackendUnavailableError(
            f"{BACKEND_ENV}={value!r} is not a backend: use one of {', '.join(BACKEND_NAMES)} "
            f"or auto"
        )
    return value


class BackendChooser:
    """Holds the backends one handler may use and picks one per job."""

    def __init__(
        self,
        backends: Mapping[str, CopyBackend],
        unavailable: Mapping[str, str],
        direction: Direction,
        policy: BackendPolicy,
        override: str | None,
        required: Sequence[str] = (),
    ) -> None:
        """override: every job's backend; required: backends that must exist (picked by name
        per job, named())."""
        for name in [override] if override is not None else required:
            if name not in backends:
                reason = unavailable.get(name, f"known backends are {', '.join(BACKEND_NAMES)}")
                raise BackendUnavailableError(f"copy backend {name!r} cannot be used: {reason}")
        if not backends:
            raise BackendUnavailableError(f"no copy backend can run here: {dict(unavailable)}")
        self._backends = dict(backends)
        self._direction = direction
        self._kernel_below = policy.kernel_below_bytes.get(direction, 0)
        self._staged_from = policy.staged_from_run_bytes
        self._staged_below = policy.staged_below_copy_bytes
        self._override = override
        for name, reason in unavailable.items():
            log.info("copy backend %s not used for %s: %s", name, direction.value, reason)

    @classmethod
    def for_handler(
        cls,
        pairs: TensorPairs,
        group_refs: Sequence[Sequence[CanonicalKVCacheRef]],
        direction: Direction,
        options: TransferOptions,
        policy: BackendPolicy,
        layout: UniformLayout | None,
        override: str | None,
        per_job: tuple[str | None, str | None] | None = None,
    ) -> BackendChooser:
        """Builds the backends of one handler's tensors: override for every job, or per_job
        the two backends picked by name per job (named()), None meaning the chooser's pick.
        The staged backend, which reserves device memory, is built only where it is named or
        the chooser could stage some job of the layout."""
        why_not = why_not_staged(pairs.cpu, group_refs, policy)
        wanted = {override} if per_job is None else set(per_job)
        staging = BackendName.STAGED in wanted or (None in wanted and why_not is None)
        gpu_to_cpu = direction is Direction.GPU_TO_CPU
        backends, unavailable = build_backends(
            pairs, group_refs, gpu_to_cpu, options, staging, layout
        )
        if why_not is not None:
            unavailable.setdefault(BackendName.STAGED, why_not)
        return cls(
            backends,
            unavailable,
            direction,
            policy,
            override if per_job is None else None,
            required=[n for n in wanted if n is not None],
        )

    @property
    def override(self) -> str | None:
        """The backend every job gets, or None where one is picked per job."""
        return self._override

    @property
    def names(self) -> list[str]:
        return sorted(self._backends)

    def choose(self, batch: CopyBatch) -> CopyBackend:
        if self._override is not None:
            return self._backends[self._override]
        if BackendName.CPU in self._backends:
            return self._backends[BackendName.CPU]
        staged = self.staged()
        if staged is not None and self._worth_staging(staged, batch):
            return staged
        kernel = self._backends.get(BackendName.KERNEL)
        if kernel is not None and batch.mean_copy_bytes < self._kernel_below:
            return kernel
        return self._backends[BackendName.DMA]

    def named(self, name: str) -> CopyBackend:
        """A backend by name (one the constructor required)."""
        return self._backends[name]

    def dma(self) -> DmaBackend | None:
        dma = self._backends.get(BackendName.DMA)
        return dma if isinstance(dma, DmaBackend) else None

    def staged(self) -> StagedBackend | None:
        staged = self._backends.get(BackendName.STAGED)
        return staged if isinstance(staged, StagedBackend) else None

    def staged_for_uniform(self, layout: UniformLayout) -> StagedBackend | None:
        """The staged backend if it is what choose() picks for every job of this uniform
        layout (kvshm.transfer.jobs.uniform), so that such jobs may skip the general planning. The
        smallest job, one block, is refs copies in one run of block_bytes; a larger job has
        the same copy sizes and no more runs than blocks, so the policy stages it too."""
        staged = self.staged()
        if staged is None or staged.buffer_bytes < layout.block_bytes:
            return None
        if self._override is not None:
            return staged if self._override == BackendName.STAGED else None
        if BackendName.CPU in self._backends:
            return None
        small = self._small_copies(layout.refs, layout.mean_page_bytes)
        return staged if small and self._long_runs(layout.refs, 1, layout.block_bytes) else None

    def uniform_pick(self, layout: UniformLayout) -> CopyBackend | None:
        """The backend choose() gives every job of this uniform layout, if one: the override,
        else staged_for_uniform's or dma_for_uniform's (never both: dma_for_uniform refuses
        the small pages that staging would take)."""
        if self._override is not None:
            return self._backends[self._override]
        return self.staged_for_uniform(layout) or self.dma_for_uniform(layout)

    def dma_for_uniform(self, layout: UniformLayout) -> DmaBackend | None:
        """The DMA backend if it is what choose() picks for every job of this uniform layout
        (whose jobs all copy pages of the same mean size, in one run per block)."""
        dma = self.dma()
        if dma is None:
            return None
        if self._override is not None:
            return dma if self._override == BackendName.DMA else None
        if BackendName.CPU in self._backends:
            return None
        # a job whose cells lie side by side forms longer runs than one block's: with small
        # copies, choose() may stage some jobs of the layout and not others
        if self.staged() is not None and layout.mean_page_bytes < self._staged_below:
            return None
        if BackendName.KERNEL in self._backends and layout.mean_page_bytes < self._kernel_below:
            return None
        return dma

    def _worth_staging(self, staged: StagedBackend, batch: CopyBatch) -> bool:
        if not self._small_copies(batch.count, batch.mean_copy_bytes):
            return False  # (before planning the runs, which costs CPU time)
        plan = staged.plan(batch)
        return plan is not None and self._long_runs(plan.copies, plan.runs, plan.mean_run_bytes)

    def _small_copies(self, copies: int, mean_copy_bytes: int) -> bool:
        return copies >= 2 and mean_copy_bytes < self._staged_below

    def _long_runs(self, copies: int, runs: int, mean_run_bytes: int) -> bool:
        return runs * 2 <= copies and mean_run_bytes >= self._staged_from
