"""Choosing each direction's copy backend from a short measurement on this host, cached per
host and layout (kvshm_calibrate, on by default).

The measurement runs once, at the worker's first transfer, before that transfer: every backend
the handlers could use moves the same jobs between scratch GPU blocks (never the engine's KV
cache) and this worker's own cells of the region, which hold nothing yet (vLLM's CPU tier
starts empty and its first job is a store): stores alone, loads alone, and every pair of store
and load backends both ways at once. The pair with the least time over the three is kept in a
JSON file keyed by host (name, GPU, driver) and layout (every tensor's page size in order,
whether the tensors are one allocation, blocks_per_chunk), so later starts on the host reuse it
without measuring.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import secrets
import socket
import stat
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from kvshm.region.safefile import create_exclusive, describe_file_type, open_checked
from kvshm.transfer import CPULoadStoreSpec, GPULoadStoreSpec, SingleDirectionOffloadingHandler
from kvshm.transfer.chooser import BACKEND_NAMES, COPY_ENGINES, SM_FREE_BACKENDS, BackendPolicy
from kvshm.transfer.metrics import Direction
from kvshm.transfer.uniform import row_pitch

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/kvshm, else ~/.cache/kvshm (read when a cache is made, not at import)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvshm"


SCRATCH_BYTES = 256 * 1024 * 1024  # GPU memory the measurement borrows, at most...
MIN_SCRATCH_BYTES = 16 * 1024 * 1024  # ...and at least (but a quarter of what is free)
MAX_SCRATCH_BLOCKS = 1024
JOB_BLOCKS = 16  # blocks per job: a request's few hundred tokens, as the benchmark moves them
REPS = 3  # medians of this many rounds
# each trial moves the scratch blocks this many times: runs of a few ms (one pass) put a
# few % of fixed cost on every backend alike and hid a 6 % difference the link shows (H100)
PASSES = 4
CACHE_VERSION = 10  # choices of earlier rules (one way only, one pair, ties to the policy, pair
# ties to DMA over staging, times taken at the CPU speed of the moment, the copy kernel tried
# at any page size or taken within KERNEL_MARGIN), of staging before its page kernel and under
# keys that told layouts apart by their distinct page sizes only expire
MARGIN = 0.03  # times within this of the fastest are a tie: runs of a few ms tell no finer
# How much of the engine's compute each backend takes (docs/transfer.md F9: matrix products
# beside DMA took 0.92-1.13x as long, beside staging 1.11-1.16x, beside the copy kernel
# 1.25-1.61x); a tie goes to the backend that takes the least, the measurement not seeing it.
SM_USE = {"dma": 0, "cpu": 0, "strided": 0, "staged": 1, "kernel": 2}
# The copy kernel holds SMs for the whole copy: beside it the engine's matrix products lost
# 6.9 ms per GB moved where beside staging they lost ~0.6 (Qwen2.5-7B stores, H100, F47), so
# it is taken only where it beats every choice without it by more than this.
KERNEL_MARGIN = 0.10
# How much slower the issuing thread may run than during the measurement: on the lent H100
# hosts one process's Python ran 1.5-2x slower at times, a neighbour sharing its core
# (docs/transfer.md F25, F29). A trial is judged at that speed, taking at least SLOW_CPU times
# its submitting: where the thread only just keeps ahead of the copies (DMA issuing a descriptor
# per 32-64 KiB page, 1024 a job: 400-680 us a job against 620 us of copies) the copies wait
# for it then. Measured as is, Llama-3.1-8B's DMA one way and a DMA store beside staging both
# ways tied or won the trial and moved 0.86-0.88 of the link at scale; staged every way, as
# now chosen, 0.94-0.97 one way and 0.87-0.92 both ways (F25, F34).
SLOW_CPU = 2.0

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


def layout_key(
    pages: Sequence[int], blocks_per_chunk: int, sm_free: bool = False, one_allocation: bool = False
) -> str:
    """Every tensor's page size in order, runs of equal sizes counted ("2x16384+1x32768B"):
    layouts of the same sizes in another order or number are measured apart. one_allocation:
    the tensors are views of one allocation at an even pitch, which the strided backend and
    its scratch blocks need (one_allocation_pitch)."""
    runs = [f"{len(list(run))}x{page}" for page, run in itertools.groupby(pages)]
    key = f"{'+'.join(runs)}B/bpc{blocks_per_chunk}"
    if one_allocation:
        key += "/one-allocation"
    key += f"/v{CACHE_VERSION}"
    return f"{key}/{COPY_ENGINES}" if sm_free else key


CHOICES = ("store", "load", "store_beside", "load_beside")


CACHE_FILE = "backend-choices.json"
# A cache holds a few hundred bytes a layout: more than this is not one (a symlink to
# /dev/zero, say), and is not read whole.
MAX_CACHE_BYTES = 1024 * 1024
# Pods sharing a node directory may read each other's choices; only the writer may change them.
CACHE_FILE_MODE = 0o644
CACHE_DIR_MODE = 0o755


class UnusableCacheError(OSError):
    """Something other than a readable cache file, or a directory, is where the cache goes."""


def _regular_file(st: os.stat_result, path: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise UnusableCacheError(f"{path} is {describe_file_type(st.st_mode)}, not a regular file")


class ChoiceCache:
    """{host: {layout: {"store": b, "load": b, "store_beside": b, "load_beside": b}}} in one
    JSON file (Measurement.choice says what each means). The file is only a cache: an entry
    that does not read as choices among the backends its mode measures is measured again, and a
    directory that cannot be written loses nothing but the next start's measurement.

    The directory may be a node directory that others can write too: the file is opened without
    following a symlink, only if it is a regular file (a FIFO would block the first transfer),
    and read up to MAX_CACHE_BYTES; anything else counts as no cache. The directory itself is
    never entered through a symlink, and the file is replaced whole, never written through."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory or default_cache_dir()
        self.path = self.directory / CACHE_FILE
        self._reported: set[str] = set()

    def _report(self, message: str) -> None:
        """Warn once per cache of each reason (get and put both read the file)."""
        if message not in self._reported:
            self._reported.add(message)
            log.warning(message)

    def _open_directory(self) -> int:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(self.directory, flags)
        except OSError as exc:
            try:
                mode = os.lstat(self.directory).st_mode
            except OSError:
                raise exc from None  # missing, or not to be looked at: the open's error says so
            if stat.S_ISDIR(mode):
                raise
            raise UnusableCacheError(
                f"{self.directory} is {describe_file_type(mode)}, not a directory; name the "
                f"directory itself in kvshm_cache_dir"
            ) from exc

    def _read(self) -> bytes:
        directory = self._open_directory()
        try:
            fd = open_checked(CACHE_FILE, os.O_RDONLY, str(self.path), directory, _regular_file)
        finally:
            os.close(directory)
        with os.fdopen(fd, "rb") as file:
            text = file.read(MAX_CACHE_BYTES + 1)
        if len(text) > MAX_CACHE_BYTES:
            raise UnusableCacheError(f"{self.path} is larger than {MAX_CACHE_BYTES} bytes")
        return text

    def load(self) -> dict[str, Any]:
        """The file's JSON object as read, unchecked ({} if there is none, or it is not a
        regular file of at most MAX_CACHE_BYTES)."""
        try:
            data = json.loads(self._read())
        except FileNotFoundError:
            return {}
        except OSError as exc:
            self._report(
                f"kvshm: not using the cached copy backends ({exc}): they are measured again"
            )
            return {}
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}

    def get(
        self, host: str, layout: str, backends: Sequence[str] = BACKEND_NAMES
    ) -> dict[str, str] | None:
        """The entry, if every choice in it is one of `backends` (those its mode measures)."""
        layouts = self.load().get(host)
        entry = layouts.get(layout) if isinstance(layouts, dict) else None
        if not isinstance(entry, dict) or not entry:
            return None
        if any(key not in CHOICES or value not in backends for key, value in entry.items()):
            log.warning(
                "kvshm: ignoring cached copy backends %s for %s in %s: not choices among %s",
                entry,
                layout,
                self.path,
                ", ".join(backends),
            )
            return None
        return entry

    def put(self, host: str, layout: str, choice: dict[str, str]) -> None:
        data = self.load()
        if not isinstance(data.get(host), dict):
            data[host] = {}
        data[host][layout] = choice
        try:
            self.directory.mkdir(mode=CACHE_DIR_MODE, parents=True, exist_ok=True)
            directory = self._open_directory()
            try:
                _replace(directory, CACHE_FILE, json.dumps(data, indent=1).encode())
            finally:
                os.close(directory)
        except OSError as exc:
            log.warning(
                "kvshm: could not keep the measured copy backends in %s (%s): the next start "
                "measures again; set kvshm_cache_dir to a writable directory",
                self.path,
                exc,
            )


def _replace(directory: int, name: str, content: bytes) -> None:
    """Replace `name` in the directory with a new file of `content`, whole: a reader sees the
    old file or the new one, never a torn one, and a symlink at the name is replaced, not
    followed."""
    for _ in range(16):
        temporary = f".{name}.{secrets.token_hex(6)}"
        fd = create_exclusive(directory, temporary, CACHE_FILE_MODE)
        if fd is not None:
            break
    else:
        raise FileExistsError(f"no free temporary name for {name}")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(content)
        os.replace(temporary, name, src_dir_fd=directory, dst_dir_fd=directory)
    except BaseException:
        os.unlink(temporary, dir_fd=directory)
        raise


def _scratch(gpu_tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Scratch GPU blocks shaped as the KV tensors: where those are views of one allocation a
    fixed pitch apart (vLLM 0.33's layer-outer cache), so are the scratch tensors, so that the
    strided backend can be measured on them."""
    per_block = sum(t.shape[1] for t in gpu_tensors)
    budget = SCRATCH_BYTES
    device = gpu_tensors[0].device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = max(MIN_SCRATCH_BYTES, min(budget, free // 4))
    blocks = max(2, min(MAX_SCRATCH_BLOCKS, budget // per_block))
    if one_allocation_pitch(gpu_tensors) is not None:
        backing = torch.empty(
            (len(gpu_tensors), blocks, gpu_tensors[0].shape[1]), dtype=torch.int8, device=device
        )
        return list(backing)
    return [torch.empty((blocks, t.shape[1]), dtype=torch.int8, device=device) for t in gpu_tensors]


def one_allocation_pitch(tensors: Sequence[torch.Tensor]) -> int | None:
    """The bytes from each tensor's first row to the next tensor's, where the tensors are rows
    of one shape in one allocation at that pitch (above their own size, no more than a 2-D
    copy takes); else None."""
    if len(tensors) < 2 or any(t.shape != tensors[0].shape for t in tensors):
        return None
    storage = tensors[0].untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != storage for t in tensors):
        return None
    size = tensors[0].shape[0] * tensors[0].stride(0) * tensors[0].element_size()
    return row_pitch([t.data_ptr() for t in tensors], size)


Spec = tuple[GPULoadStoreSpec, CPULoadStoreSpec]


@dataclass(frozen=True)
class Workload:
    """Jobs of JOB_BLOCKS random blocks between the scratch tensors and this worker's cells:
    each one-way run moves every scratch block once; the both-ways run stores one half of them
    while it loads the other, the same bytes in all."""

    every: list[Spec]
    stores: list[Spec]
    loads: list[Spec]

    @classmethod
    def of(
        cls, scratch_blocks: int, num_chunks: int, groups: int, blocks_per_chunk: int
    ) -> Workload:
        rng = np.random.default_rng(0)
        per_job = max(blocks_per_chunk, JOB_BLOCKS - JOB_BLOCKS % blocks_per_chunk)
        blocks = min(scratch_blocks, num_chunks * blocks_per_chunk)
        if blocks >= 2 * per_job:
            blocks -= blocks % (2 * per_job)  # whole jobs, in both halves
        gpu = rng.permutation(blocks)
        cpu = rng.choice(num_chunks, -(-blocks // blocks_per_chunk), replace=False)

        def jobs(first: int, last: int) -> list[Spec]:
            out = []
            for at in range(first, last, per_job):
                n = min(per_job, last - at)
                sizes = [n] + [0] * (groups - 1)  # the tensors of group 0 carry the pages
                chunk = at // blocks_per_chunk
                out.append(
                    (
                        GPULoadStoreSpec(gpu[at : at + n], sizes, [0] * groups),
                        CPULoadStoreSpec(cpu[chunk : chunk + -(-n // blocks_per_chunk)]),
                    )
                )
            return out

        half = blocks // 2
        return cls(jobs(0, blocks), jobs(0, half), jobs(half, blocks))


def _run(
    store: SingleDirectionOffloadingHandler | None,
    load: SingleDirectionOffloadingHandler | None,
    stores: Sequence[Spec],
    loads: Sequence[Spec],
    ids: Iterator[int],
) -> float | None:
    """Issue the stores and loads interleaved, as an engine's steps do, PASSES times over; wait.
    Returns the seconds submitting took (the first pass's times PASSES: later passes may
    queue behind a full command buffer), or None if a job failed."""
    issued: list[tuple[SingleDirectionOffloadingHandler, int]] = []
    submitting = 0.0
    for each in range(PASSES):
        started = time.perf_counter()
        for i in range(max(len(stores), len(loads))):
            if store is not None and i < len(stores):
                gpu, cpu = stores[i]
                issued.append((store, job := next(ids)))
                store.transfer_async(job, gpu, cpu)
            if load is not None and i < len(loads):
                gpu, cpu = loads[i]
                issued.append((load, job := next(ids)))
                load.transfer_async(job, cpu, gpu)
        if each == 0:
            submitting = (time.perf_counter() - started) * PASSES
    for handler, job in issued:
        handler.wait([job])
    results = [r for h in {id(h): h for h, _ in issued}.values() for r in h.get_finished()]
    if len(results) != len(issued) or not all(r.success for r in results):
        return None
    return submitting


def measured_backends(sm_free: bool) -> tuple[str, ...]:
    """The backends a measurement may choose among, of those the handlers have: under
    copy-engines those that leave the SMs to the model, else every one but the strided
    backend (worth_trying says why)."""
    if sm_free:
        return SM_FREE_BACKENDS
    return tuple(b for b in BACKEND_NAMES if b != "strided")


def worth_trying(
    backends: Sequence[str], pages: Sequence[int], gpu_to_cpu: bool, sm_free: bool = False
) -> list[str]:
    """The backends the measurement tries for pages of these sizes.

    sm_free (kvshm_backend: copy-engines): those that leave the SMs to the model. Otherwise
    not the strided backend, whose trial on scratch blocks tied with staging's within MARGIN
    where at scale it moved 5-10 % less both ways (H100), and the copy kernel only where the
    policy would give it the jobs (pages averaging under its kernel_below_bytes), where the
    copy engines are bound by their descriptors: it holds SMs for the whole transfer (beside
    it the engine's matrix products lost 6-26 ms per GB moved, beside DMA 0-0.5, H100,
    docs/transfer.md F43), and at pages of 0.9-1.3 MiB, where a trial judged at half the
    CPU's speed had chosen it, it moved less than DMA does."""
    tried = [b for b in backends if b in measured_backends(sm_free)]
    if sm_free:
        return tried
    direction = Direction.GPU_TO_CPU if gpu_to_cpu else Direction.CPU_TO_GPU
    kernel_below = BackendPolicy().kernel_below_bytes.get(direction, 0)
    mean_page = sum(pages) / max(len(pages), 1)
    others = [b for b in tried if b != "kernel"]
    if "kernel" in tried and others and mean_page >= kernel_below:
        return others
    return tried


def judged_seconds(wall: float, submitting: float) -> float:
    """A trial's time with the issuing thread SLOW_CPU times slower than it ran."""
    return max(wall, SLOW_CPU * submitting)


def _seconds(
    store: SingleDirectionOffloadingHandler | None,
    load: SingleDirectionOffloadingHandler | None,
    stores: Sequence[Spec],
    loads: Sequence[Spec],
    ids: Iterator[int],
    device: torch.device,
) -> float:
    """One run's time, judged_seconds; infinite if any job failed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    submitting = _run(store, load, stores, loads, ids)
    if submitting is None:
        return float("inf")
    return judged_seconds(time.perf_counter() - started, submitting)


def measure(
    make: HandlerFactory,
    scratch: Sequence[torch.Tensor],
    num_chunks: int,
    groups: int,
    blocks_per_chunk: int,
    measure_stores: bool = True,
    sm_free: bool = False,
) -> Measurement:
    """Every backend each direction may use, alone; and every pair of them both ways at once.
    sm_free: only those that leave the SMs to the model (SM_FREE_BACKENDS)."""
    work = Workload.of(scratch[0].shape[0], num_chunks, groups, blocks_per_chunk)
    device = scratch[0].device
    ids = itertools.count(1)
    directions = (("store", True), ("load", False)) if measure_stores else (("load", False),)
    handlers: dict[str, dict[str, SingleDirectionOffloadingHandler]] = {}
    try:
        policy: dict[str, str] = {}
        pages = [t.shape[1] for t in scratch]
        for name, gpu_to_cpu in directions:
            probe = make(gpu_to_cpu, None, scratch)
            candidates = worth_trying(probe.backends, pages, gpu_to_cpu, sm_free)
            gpu, cpu = work.every[0]
            policy[name] = (
                probe.backend_for(gpu, cpu) if gpu_to_cpu else probe.backend_for(cpu, gpu)
            )
            probe.shutdown()
            handlers[name] = {b: make(gpu_to_cpu, b, scratch) for b in candidates}
        trials: dict[tuple[str, str, str], Callable[[], float]] = {}
        work_of = {"store": (work.every, []), "load": ([], work.every)}
        for name, by_backend in handlers.items():
            for backend, handler in by_backend.items():
                store, load = (handler, None) if name == "store" else (None, handler)
                trials[(name, backend, "")] = functools.partial(
                    _seconds, store, load, *work_of[name], ids, device
                )
        if measure_stores:
            for (s, store), (ld, load) in itertools.product(
                handlers["store"].items(), handlers["load"].items()
            ):
                trials[("both", s, ld)] = functools.partial(
                    _seconds, store, load, work.stores, work.loads, ids, device
                )
        # rounds over every trial, so that a clock ramp or a neighbour's burst falls on all of
        # them alike; the first round warms up (compiles kernels, maps buffers) and is dropped
        times: dict[tuple[str, str, str], list[float]] = {key: [] for key in trials}
        for rep in range(REPS + 1):
            for key, trial in trials.items():
                seconds = trial()
                if rep:
                    times[key].append(seconds)
        median = {key: statistics.median(values) for key, values in times.items()}
        alone = {
            name: {backend: median[(name, backend, "")] for backend in by_backend}
            for name, by_backend in handlers.items()
        }
        both = {(s, ld): t for (kind, s, ld), t in median.items() if kind == "both"}
    finally:
        for by_backend in handlers.values():
            for handler in by_backend.values():
                handler.shutdown()
    return Measurement(alone, both, policy)


@dataclass(frozen=True)
class Measurement:
    alone: dict[str, dict[str, float]]
    """{"store"|"load": {backend: seconds}} for the same bytes one way (judged_seconds)."""
    both: dict[tuple[str, str], float]
    """{(store backend, load backend): seconds} for the same bytes, half each way at once
    (judged_seconds)."""
    policy: dict[str, str] = field(default_factory=dict)
    """{"store"|"load": the backend the per-block-size policy gives these jobs}."""

    def choice(self) -> dict[str, str]:
        """Per direction the backend for jobs while the other direction is idle ("store",
        "load": the fastest alone) and while it is busy ("store_beside", "load_beside": the
        fastest pair both ways at once): on some hosts the copy engines win one way while
        staging wins both ways, one thread issuing both directions' descriptors. Times within
        MARGIN of the fastest are a tie, which goes to the backend (or pair) that takes the
        least of the engine's SMs (SM_USE), then to the per-block-size policy's pick, then the
        faster; the copy kernel must be faster than every choice without it by KERNEL_MARGIN.
        The times are judged_seconds: what the issuing thread takes counts too."""
        choice = {
            name: _break_ties({(b,): t for b, t in times.items()}, (self.policy.get(name, ""),))[0]
            for name, times in self.alone.items()
        }
        if not self.both:
            return choice
        policy_pair = (self.policy.get("store", ""), self.policy.get("load", ""))
        store, load = _break_ties(self.both, policy_pair)
        return {**choice, "store_beside": store, "load_beside": load}

    def summary(self) -> str:
        alone = {n: {b: round(s * 1e3, 2) for b, s in t.items()} for n, t in self.alone.items()}
        both = {f"{s}+{ld}": round(t * 1e3, 2) for (s, ld), t in self.both.items()}
        return f"ms alone {alone}, both ways {both}"


Backends = TypeVar("Backends", bound=tuple[str, ...])  # one backend, or a store+load pair


def _break_ties(times: Mapping[Backends, float], policy: Backends) -> Backends:
    """The fastest backends, a tie (within MARGIN) going to what takes the least of the
    engine's SMs (SM_USE), then the policy; the copy kernel only where it is faster than
    every choice without it by KERNEL_MARGIN."""
    without_kernel = {key: t for key, t in times.items() if "kernel" not in key}
    if without_kernel and min(without_kernel.values()) <= min(times.values()) * (1 + KERNEL_MARGIN):
        times = without_kernel
    fastest = min(times.values())
    tied = [key for key, seconds in times.items() if seconds <= fastest * (1 + MARGIN)]

    def rank(key: Backends) -> tuple[int, bool, float]:
        return sum(SM_USE.get(b, 2) for b in key), key != policy, times[key]

    return min(tied, key=rank)


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
    scratch = _scratch(gpu_tensors)
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
