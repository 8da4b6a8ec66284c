"""Which backend takes one handler's job, and how: as a uniform job, its tables from the block
ids alone (kvshm.transfer.jobs.uniform), or through the general planner.

A backend takes the uniform jobs of the handler's layout where its prepare_uniform accepts the
layout: the jobs named for it, and the chooser's own picks (jobs named None) where the chooser
gives it every job of the layout anyway, so that skipping the planner changes no choice. Any
other job, and any spec the layout does not recognise, goes to the general planner, which
names what is wrong with a bad spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from kvshm.transfer.backends.base import CopyBackend
from kvshm.transfer.choice.chooser import BackendChooser
from kvshm.transfer.jobs.plan import JobPlanner
from kvshm.transfer.jobs.uniform import UniformJob, UniformLayout
from kvshm.transfer.jobs.work import Stream, Work


@dataclass(frozen=True)
class Route:
    """A job's backend, the work that issues it on a stream, and the bytes it moves."""

    backend: CopyBackend
    work: Work
    size_bytes: int


class JobRouter:
    """Routes the jobs of one handler's tensors; built once, with the handler."""

    def __init__(
        self,
        chooser: BackendChooser,
        planner: JobPlanner,
        layout: UniformLayout | None,
        gpu_to_cpu: bool,
    ) -> None:
        self._chooser = chooser
        self._planner = planner
        self._layout = layout
        self._gpu_to_cpu = gpu_to_cpu
        # by the name a job carries (None: the chooser's pick), the backend taking it as uniform
        self._uniform: dict[str | None, CopyBackend] = {}
        if layout is None:
            return
        for name in chooser.names:
            backend = chooser.named(name)
            if backend.prepare_uniform(layout) is None:
                self._uniform[name] = backend
        pick = chooser.uniform_pick(layout)
        if pick is not None and self._uniform.get(pick.name) is pick:
            self._uniform[None] = pick

    def uniform_backend(self, named: str | None) -> CopyBackend | None:
        """The backend that takes a job so named as a uniform job, if one does."""
        return self._uniform.get(named)

    def route(self, named: str | None, spec: object, after: Stream | None) -> Route:
        """The job's route: named, the backend named for it (None: the chooser picks by the
        job); after, the stream whose queued work the job must follow. A spec that does not
        describe a valid transfer raises InvalidTransferSpecError."""
        uniform = self._uniform.get(named)
        job = None if uniform is None else self._uniform_job(spec)
        if uniform is not None and job is not None:
            return Route(uniform, partial(uniform.copy_uniform, job, after=after), job.total_bytes)
        batch = self._planner.plan(spec)
        backend = self._chooser.choose(batch) if named is None else self._chooser.named(named)
        return Route(backend, partial(backend.copy, batch, after=after), batch.total_bytes)

    def backend_for(self, named: str | None, spec: object) -> str:
        """The name of the backend route() would give the job (nothing is issued)."""
        if named is not None:
            return named
        uniform = self._uniform.get(None)
        if uniform is not None and self._uniform_job(spec) is not None:
            return uniform.name
        return self._chooser.choose(self._planner.plan(spec)).name

    def _uniform_job(self, spec: object) -> UniformJob | None:
        assert self._layout is not None  # (a backend takes uniform jobs only with a layout)
        return self._layout.job(spec, self._gpu_to_cpu)
