"""Which backend takes a job, and whether as a uniform job or through the general planner
(kvshm.transfer.choice.routing), with the real DMA, staged and strided backends on addresses only:
nothing is issued."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch

from kvshm.transfer import (
    BackendPolicy,
    CPULoadStoreSpec,
    Direction,
    GPULoadStoreSpec,
    InvalidTransferSpecError,
)
from kvshm.transfer.backends import staged as staged_module
from kvshm.transfer.backends.base import BackendName, CopyBackend
from kvshm.transfer.backends.dma import DmaBackend
from kvshm.transfer.backends.kernel import KernelBackend
from kvshm.transfer.backends.staged import StagedBackend
from kvshm.transfer.backends.strided import StridedBackend
from kvshm.transfer.choice.chooser import BackendChooser
from kvshm.transfer.choice.routing import JobRouter, Route
from kvshm.transfer.cuda.driver import CopyDirection, CudaDriver
from kvshm.transfer.jobs.batch import CopyBatch
from kvshm.transfer.jobs.plan import JobPlanner
from kvshm.transfer.jobs.pointers import RowGeometry
from kvshm.transfer.jobs.uniform import UniformLayout
from kvshm.transfer.jobs.work import Stream

from .helpers import CPU_ROWS, GPU_ROWS, cpu_views, one_group

KIB = 1024
MIB = 1024 * KIB
STAGING_BUFFER = 8 * MIB
SMALL = (32, 16 * KIB)  # refs x page: staged by the policy (512 KiB runs of small pages)
LARGE = (2, 2 * MIB)  # by DMA (pages the copy engines take as they are)


class Kernel(CopyBackend):
    name = BackendName.KERNEL

    def copy(self, batch: CopyBatch, stream: Stream, after: Stream | None = None) -> None:
        raise AssertionError("nothing is issued here")


def layer_outer(refs: int, page: int) -> list[RowGeometry]:
    """One allocation, layer t's pages from t * GPU_ROWS * page on (so one 2-D copy a block)."""
    base = 1 << 40
    return [RowGeometry(base + t * GPU_ROWS * page, page, page, GPU_ROWS) for t in range(refs)]


@pytest.fixture(autouse=True)
def no_page_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """The page kernel compiles for a GPU: the staged backend's uniform jobs take the table
    path here, as they do for a layout the page kernel refuses."""
    monkeypatch.setattr(staged_module, "page_kernel_refusal", lambda layout: "no GPU here")


class Handler:
    """What a store handler builds for the router: its chooser, planner and layout."""

    def __init__(
        self,
        shape: tuple[int, int],
        override: str | None = None,
        staging_buffer: int = STAGING_BUFFER,
        uniform: bool = True,
    ) -> None:
        refs, page = shape
        pages = [page] * refs
        gpu, cpu, group = layer_outer(refs, page), cpu_views(pages, refs * page), one_group(pages)
        self.layout = UniformLayout.of(gpu, cpu, 1, group)
        assert self.layout is not None
        dma = DmaBackend(cast(CudaDriver, SimpleNamespace(has_batch=True)), CopyDirection(True, 0))
        device_copies = cast(KernelBackend, Kernel())
        self.backends: dict[str, CopyBackend] = {
            BackendName.DMA: dma,
            BackendName.KERNEL: Kernel(),
            BackendName.STAGED: StagedBackend(
                torch.device("cpu"), True, dma, device_copies, staging_buffer, 2
            ),
            BackendName.STRIDED: StridedBackend(cast(CudaDriver, SimpleNamespace()), dma, True),
        }
        self.chooser = BackendChooser(
            self.backends, {}, Direction.GPU_TO_CPU, BackendPolicy(), override
        )
        self.planner = JobPlanner(gpu, cpu, 1, group, True)
        layout = self.layout if uniform else None
        self.router = JobRouter(self.chooser, self.planner, layout, True)

    def planned_choice(self, spec: object) -> CopyBackend:
        return self.chooser.choose(self.planner.plan(spec))


def store(count: int = 16, seed: int = 0, gpu_rows: int = GPU_ROWS) -> tuple[Any, Any]:
    rng = np.random.default_rng(seed)
    gpu_ids, cpu_ids = rng.permutation(gpu_rows)[:count], rng.permutation(CPU_ROWS)[:count]
    return GPULoadStoreSpec(gpu_ids, [count], [0]), CPULoadStoreSpec(cpu_ids)


def is_uniform(route: Route, backend: CopyBackend, handler: Handler) -> bool:
    work = cast(Any, route.work)
    assert handler.layout is not None
    return (
        route.backend is backend
        and work.func == backend.copy_uniform
        and route.size_bytes == 16 * handler.layout.block_bytes
    )


def is_planned(route: Route, backend: CopyBackend) -> bool:
    work = cast(Any, route.work)
    return route.backend is backend and work.func == backend.copy


@pytest.mark.parametrize("name", ["dma", "staged", "strided"])
@pytest.mark.parametrize("shape", [SMALL, LARGE], ids=["small-pages", "large-pages"])
def test_a_job_named_for_a_backend_that_takes_the_layout_is_uniform(
    name: str, shape: tuple[int, int]
) -> None:
    handler = Handler(shape)
    route = handler.router.route(name, store(), None)
    assert is_uniform(route, handler.backends[name], handler)
    assert handler.router.backend_for(name, store()) == name


def test_a_job_named_for_a_backend_without_uniform_jobs_is_planned() -> None:
    handler = Handler(SMALL)
    route = handler.router.route("kernel", store(), None)
    assert is_planned(route, handler.backends["kernel"])
    assert route.size_bytes == handler.planner.plan(store()).total_bytes
    assert handler.router.uniform_backend("kernel") is None


@pytest.mark.parametrize(
    ("shape", "override", "expected"),
    [
        (SMALL, None, "staged"),  # the chooser stages every job of the layout
        (LARGE, None, "dma"),  # and gives DMA every job of this one
        (SMALL, "strided", "strided"),
        (LARGE, "staged", "staged"),
        (SMALL, "dma", "dma"),
    ],
)
def test_the_choosers_pick_is_uniform_where_it_gives_the_backend_every_job(
    shape: tuple[int, int], override: str | None, expected: str
) -> None:
    """Skipping the planner changes no choice: the backend is the one choose() gives the
    planned job."""
    handler = Handler(shape, override)
    route = handler.router.route(None, store(), None)
    assert is_uniform(route, handler.backends[expected], handler)
    assert handler.planned_choice(store()) is route.backend
    assert handler.router.backend_for(None, store()) == expected


def test_the_choosers_pick_is_planned_where_it_does_not_take_uniform_jobs() -> None:
    handler = Handler(SMALL, "kernel")
    assert is_planned(handler.router.route(None, store(), None), handler.backends["kernel"])
    assert handler.router.uniform_backend(None) is None
    assert handler.router.backend_for(None, store()) == "kernel"


def test_a_staging_buffer_smaller_than_a_block_leaves_staged_jobs_to_the_planner() -> None:
    handler = Handler(SMALL, staging_buffer=256 * KIB)
    staged = handler.backends["staged"]
    assert is_planned(handler.router.route("staged", store(), None), staged)
    assert handler.router.uniform_backend(None) is None  # where staging would be the pick
    route = handler.router.route(None, store(), None)
    assert is_planned(route, handler.planned_choice(store()))


def test_without_a_uniform_layout_every_job_is_planned() -> None:
    handler = Handler(SMALL, uniform=False)
    for name in (None, "dma", "staged", "strided"):
        route = handler.router.route(name, store(), None)
        expected = handler.planned_choice(store()) if name is None else handler.backends[name]
        assert is_planned(route, expected), name


@pytest.mark.parametrize("name", [None, "dma", "staged", "strided"])
def test_a_spec_the_layout_does_not_take_goes_to_the_planner_which_names_the_error(
    name: str | None,
) -> None:
    handler = Handler(SMALL)
    bad = store(gpu_rows=GPU_ROWS + 8, seed=1)  # some GPU id past the tensors
    with pytest.raises(InvalidTransferSpecError):
        handler.router.route(name, bad, None)
    if name is None:
        with pytest.raises(InvalidTransferSpecError):
            handler.router.backend_for(name, bad)


def test_a_backend_says_why_it_takes_no_uniform_jobs(caplog: pytest.LogCaptureFixture) -> None:
    handler = Handler(SMALL)
    assert handler.layout is not None
    assert "takes no uniform jobs" in str(Kernel().prepare_uniform(handler.layout))
    cells_apart = [
        RowGeometry((1 << 40) + (t << 32), 16 * KIB, 16 * KIB, GPU_ROWS) for t in range(32)
    ]
    pages = [16 * KIB] * 32
    apart = UniformLayout.of(cells_apart, cpu_views(pages, 512 * KIB), 1, one_group(pages))
    assert apart is not None
    strided = handler.backends["strided"]
    assert "one stride" in str(strided.prepare_uniform(apart))
    small = StagedBackend(torch.device("cpu"), True, handler.backends["dma"], Kernel(), KIB, 2)  # type: ignore[arg-type]
    assert "does not fit a staging buffer" in str(small.prepare_uniform(handler.layout))
    job = handler.layout.job(store(), True)
    assert job is not None
    with pytest.raises(ValueError, match="prepare_uniform"):
        small.copy_uniform(job, None)
    with caplog.at_level(logging.INFO):
        Handler(SMALL)
    assert "uniform jobs gather through kernel tables: no GPU here" in caplog.text
