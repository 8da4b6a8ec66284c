"""What bench/attach and bench/populate share: the region geometry of a real model, vLLM 0.33's
region opened exactly as its CPUOffloadingSpec.create_worker opens it, a region directory shown
to vLLM as /dev/shm, the agent's region made beforehand, and rank processes run as vLLM runs its
tensor-parallel workers (one process each, a multiprocessing.Barrier standing in for the gloo
group barrier vLLM passes)."""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing
import os
import queue
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.synchronize import Barrier, Event
from pathlib import Path
from typing import Any

from bench import vllm_modules
from kvshm.region import RegionFormat, RegionLayout, SharedOffloadRegion
from kvshm.region.naming import MAX_SEGMENTS

GIB = 1024**3
DEV_SHM = "/dev/shm"
BARRIER_TIMEOUT_S = 300.0  # a rank that dies must not hang the others forever
SPAWN = multiprocessing.get_context("spawn")  # CUDA in the ranks: never fork

# Per-worker cell of one block (block size 16, bf16 KV cache, blocks_per_chunk 1) as vLLM 0.33
# computes it: layers x 2 (K, V) x 16 tokens x KV heads / TP x head dim x 2 bytes.
MODEL_CELLS = {
    1: ("Llama-3.1-8B", 32 * 2 * 16 * 8 * 128 * 2),  # 2 MiB
    2: ("Llama-3.1-70B", 80 * 2 * 16 * 4 * 128 * 2),
    4: ("Llama-3.1-70B", 80 * 2 * 16 * 2 * 128 * 2),  # 1,310,720 bytes
    8: ("Llama-3.1-70B", 80 * 2 * 16 * 1 * 128 * 2),
}


@dataclass(frozen=True)
class Geometry:
    """One region: num_chunks rows, tp cells of cell_bytes each, rows padded as vLLM pads."""

    model: str
    tp: int
    cell_bytes: int
    num_chunks: int

    @classmethod
    def for_size(cls, gib: float, tp: int) -> Geometry:
        if tp not in MODEL_CELLS:
            raise SystemExit(f"--tp {tp}: choose one of {sorted(MODEL_CELLS)}")
        model, cell = MODEL_CELLS[tp]
        stride = RegionLayout(1, cell, tp).row_stride
        return cls(model, tp, cell, max(1, -(-int(gib * GIB) // stride)))

    def split(self, tp: int) -> Geometry:
        """The same rows, each split into tp cells (a TP-tp engine's view of these bytes)."""
        if self.row_stride % tp:
            raise SystemExit(f"a {self.row_stride}-byte row does not split into {tp} cells")
        return Geometry(self.model, tp, self.row_stride // tp, self.num_chunks)

    @property
    def row_stride(self) -> int:
        """vLLM's kv_bytes_per_chunk: round_up(cell x world size, 4096)."""
        return self.kvshm_layout().row_stride

    @property
    def size_bytes(self) -> int:
        return self.num_chunks * self.row_stride

    def kvshm_layout(self) -> RegionLayout:
        return RegionLayout(self.num_chunks, self.cell_bytes, self.tp, RegionFormat.VLLM_0_33)

    def describe(self) -> str:
        layout = self.kvshm_layout()
        return (
            f"{self.size_bytes / GIB:.2f} GiB, TP {self.tp} ({self.model}: {self.num_chunks} rows "
            f"of {self.tp} x {self.cell_bytes} B cells, {self.row_stride} B rows, "
            f"{layout.file_count} files)"
        )


def open_vllm_region(
    vllm: Any, engine_id: str, geometry: Geometry, rank: int | None, barrier: Barrier | None
) -> Any:
    """vLLM's own SharedOffloadRegion, called with the arguments CPUOffloadingSpec.create_worker
    passes for a non-replicated layout (rank = the worker's rank, its barrier, 32 segments)."""
    return vllm.SharedOffloadRegion(
        engine_id=engine_id,
        num_chunks=geometry.num_chunks,
        rank=rank,
        kv_bytes_per_chunk=geometry.row_stride,
        cpu_page_size=geometry.cell_bytes,
        barrier=None if barrier is None else barrier.wait,
        num_segments=MAX_SEGMENTS,
    )


_CLONE_NEWNS = 0x00020000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18


def show_as_dev_shm(directory: str) -> None:
    """Make `directory` this process's /dev/shm (a private mount namespace), as a serving pod
    sees its region directory; vLLM 0.33 always opens /dev/shm/vllm_offload_<id>.mmap."""
    if os.path.realpath(directory) == DEV_SHM:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    steps: tuple[tuple[str, Callable[[], int]], ...] = (
        ("unshare(CLONE_NEWNS)", lambda: libc.unshare(_CLONE_NEWNS)),
        (
            "mount --make-rprivate /",
            lambda: libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None),
        ),
        (
            f"mount --bind {directory} {DEV_SHM}",
            lambda: libc.mount(directory.encode(), DEV_SHM.encode(), None, _MS_BIND, None),
        ),
    )
    for what, step in steps:
        if step() != 0:
            err = ctypes.get_errno()
            raise SystemExit(
                f"{what} failed ({os.strerror(err)}): vLLM only opens {DEV_SHM}, so a --directory "
                f"other than {DEV_SHM} needs root (CAP_SYS_ADMIN) to be shown to it there"
            )


def agent_region(
    instance_id: str, geometry: Geometry, directory: str, ready: Any, done: Event
) -> None:
    """The kvshm agent's part, in its own process: create, populate and lock the region (as
    the agent's hosting does), report, hold it until told, then remove it."""
    region = SharedOffloadRegion(
        instance_id, geometry.kvshm_layout(), directory=directory, mode="create", populate=True
    )
    try:
        locked = ""
        try:
            region.lock()
        except OSError as exc:  # no IPC_LOCK: the agent would report it; the bench goes on
            locked = f"not locked ({exc.strerror})"
        ready.put(
            {
                "populate_s": region.populate_seconds,
                "allocated": region.is_fully_allocated(),
                "files": len(region.files),
                "locked": locked or "locked",
            }
        )
        done.wait()
    finally:
        region.cleanup()


class AgentRegion:
    """The agent's region, made beforehand in a separate process and held until close()."""

    def __init__(self, instance_id: str, geometry: Geometry, directory: str) -> None:
        self._ready: Any = SPAWN.Queue()
        self._done = SPAWN.Event()
        self._process = SPAWN.Process(
            target=agent_region,
            args=(instance_id, geometry, directory, self._ready, self._done),
            name="kvshm-agent",
        )
        self._process.start()
        self.report: dict[str, Any] = _get(self._ready, [self._process], "the agent's region")
        if not self.report["allocated"]:
            raise SystemExit("the agent's region is not fully allocated after populate")

    def close(self) -> None:
        self._done.set()
        self._process.join()
        if self._process.exitcode != 0:
            raise SystemExit(f"the agent's process exited with {self._process.exitcode}")


def _get(results: Any, processes: list[Any], what: str) -> dict[str, Any]:
    """The next result, or SystemExit when a process died without sending one."""
    while True:
        try:
            result: dict[str, Any] = results.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in processes if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"{what}: {dead[0].name} exited with {dead[0].exitcode}") from None
            continue
        if "error" in result:
            raise SystemExit(f"{what} failed:\n{result['error']}")
        return result


def run_ranks(target: Callable[..., None], tp: int, *args: Any) -> list[dict[str, Any]]:
    """Run target(rank, start_barrier, vllm_barrier, results, *args) in tp processes and return
    each rank's result. start_barrier lines them up after their set-up (imports, CUDA), so
    timings start together; vllm_barrier is the barrier vLLM's region code is given."""
    start, barrier = (
        SPAWN.Barrier(tp, timeout=BARRIER_TIMEOUT_S),
        SPAWN.Barrier(tp, timeout=BARRIER_TIMEOUT_S),
    )
    results: Any = SPAWN.Queue()
    processes = [
        SPAWN.Process(
            target=_rank_main,
            args=(target, rank, start, barrier, results, *args),
            name=f"rank{rank}",
        )
        for rank in range(tp)
    ]
    for process in processes:
        process.start()
    try:
        what = f"rank processes of {target.__name__}"
        collected = [_get(results, processes, what) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=BARRIER_TIMEOUT_S)
            if process.is_alive():
                process.kill()
                process.join()
    failed = [p.name for p in processes if p.exitcode != 0]
    if failed:
        raise SystemExit(f"{', '.join(failed)} exited with an error")
    return sorted(collected, key=lambda result: int(result["rank"]))


def _rank_main(
    target: Callable[..., None],
    rank: int,
    start: Barrier,
    barrier: Barrier,
    results: Any,
    *args: Any,
) -> None:
    try:
        target(rank, start, barrier, results, *args)
    except BaseException:
        results.put({"rank": rank, "error": f"rank {rank}:\n{traceback.format_exc()}"})
        start.abort()
        barrier.abort()
        raise


def add_region_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--directory", default=DEV_SHM, help="tmpfs for the regions")
    parser.add_argument("--vllm-src", help="directory holding vllm/... (default .vllm-src)")


def vllm_source(args: argparse.Namespace) -> tuple[str | None, str]:
    """The vLLM source root the rank processes load (None: the default) and a line saying
    which vLLM it is, after loading it here once to check it."""
    root = str(Path(args.vllm_src).resolve()) if args.vllm_src else None
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not vLLM's INFO lines per rank
    loaded = vllm_modules.load(Path(root) if root else None)
    return root, f"{loaded.describe()}; {len(os.sched_getaffinity(0))} cores; {args.directory}"
