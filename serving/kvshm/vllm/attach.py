"""Attaching the agent's region for one worker: attach-only, checked against vLLM's geometry.

Everything the plugin knows about region files goes through attach_region, so a change of
kvshm.region's API is a change here only.
"""

from __future__ import annotations

import logging
import os
import stat
import time

from kvshm.region import (
    RegionError,
    RegionFileMissingError,
    RegionResizedError,
    RegionSizeMismatchError,
    RegionSpaceError,
    SharedOffloadRegion,
    safefile,
    segment_file_name,
)
from kvshm.region.locks import byte_lock_holder_pid, try_lock_byte
from kvshm.region.naming import MAX_SEGMENT_INDEX
from kvshm.region.shared_region import OpenMode
from kvshm.vllm.geometry import RegionGeometry

log = logging.getLogger(__name__)


class RegionGeometryMismatch(RegionError):
    """The agent's region does not have the geometry vLLM computed for this engine."""


class RegionServesAnotherEngine(RegionError):
    """A worker of another engine already attached the region as this worker's rank."""


class RegionCellsOutOfSpace(RegionError):
    """A region not fully allocated (populate: false) whose tmpfs has no room left for this
    worker's cells."""


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _mismatch(instance_id: str, expected: RegionGeometry, found: str) -> str:
    layout = expected.region_layout()
    names = ", ".join(f.name for f in layout.files(instance_id))
    return (
        f"vLLM computed a CPU offload region of {expected.describe()} for engine "
        f"{instance_id!r}, which vLLM 0.33 keeps in {_plural(layout.file_count, 'file')} "
        f"({names}), but {found}. The OffloadRegion with instanceId {instance_id!r} must have "
        f"{expected.offload_region_layout()} (see 'kvshm layout'), or change "
        f"cpu_bytes_to_use/blocks_per_chunk in kv_connector_extra_config to match the region."
    )


def _found(exc: RegionSizeMismatchError) -> str:
    if isinstance(exc, RegionFileMissingError):
        return f"the kvshm region file {exc.path} is missing"
    return (
        f"the kvshm region file {exc.path} is {exc.actual_bytes} bytes where vLLM expects "
        f"{exc.expected_bytes}"
    )


def _on_disk(directory: str, instance_id: str, expected: RegionGeometry) -> str:
    """What the directory holds under the region's file names, from lstat alone (relative to a
    descriptor of the directory; nothing is opened): file count, total bytes and rows."""
    try:
        dir_fd = safefile.open_directory(directory)
    except OSError as exc:
        return f"{directory} could not be listed ({exc.strerror})"
    sizes: list[int] = []
    names: list[str] = []
    oddities: list[str] = []
    try:
        for segment in range(MAX_SEGMENT_INDEX + 1):
            name = segment_file_name(instance_id, segment)
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                sizes.append(st.st_size)
                names.append(name if segment == 0 else f".mmap.{segment}")
            else:
                oddities.append(f"{name} is {safefile.describe_file_type(st.st_mode)}")
    finally:
        os.close(dir_fd)
    total = sum(sizes)
    rows, rest = divmod(total, expected.row_stride)
    summary = (
        f"in all, {directory} holds {_plural(len(sizes), 'file')} of the region"
        + (f" ({', '.join(names)})" if names else "")
        + f": {total} bytes, "
        + (
            f"{_plural(rows, 'row')} of {expected.row_stride} bytes"
            if not rest
            else f"not a whole number of {expected.row_stride}-byte rows"
        )
    )
    return "; ".join([summary, *oddities])


def _geometry_mismatch(
    directory: str, instance_id: str, expected: RegionGeometry, found: str
) -> RegionGeometryMismatch:
    on_disk = _on_disk(directory, instance_id, expected)
    return RegionGeometryMismatch(_mismatch(instance_id, expected, f"{found}; {on_disk}"))


def attach_region(
    directory: str,
    instance_id: str,
    expected: RegionGeometry,
    rank: int,
    attach_timeout_s: float,
) -> SharedOffloadRegion:
    """Map the agent's region (its files in `directory`, split as vLLM 0.33 splits them) for
    worker `rank`.

    Never creates, truncates or removes a file; waits up to attach_timeout_s for the region to
    appear. A region whose pages are not all allocated (populate: false) gets this worker's
    cells allocated here, so a full tmpfs is an error now rather than a SIGBUS at the first
    store. The returned region holds a shared flock on file 0 (the agent counts it as a holder)
    and a write lock on file 0's byte `rank` (a second engine's worker of that rank is refused)
    until cleanup().
    """
    if expected.num_chunks < 1:
        raise RegionGeometryMismatch(
            f"vLLM computed no CPU offload chunks for engine {instance_id!r} (cpu_bytes_to_use "
            f"is below one row of {expected.row_stride} bytes): raise cpu_bytes_to_use"
        )
    layout = expected.region_layout()
    if layout.row_stride != expected.row_stride:
        raise RegionGeometryMismatch(
            _mismatch(
                instance_id,
                expected,
                f"kvshm lays that layout out in rows of {layout.row_stride} bytes, not vLLM's "
                f"{expected.row_stride}: this kvshm version does not match this vLLM version",
            )
        )
    try:
        region = SharedOffloadRegion(
            instance_id,
            layout,
            rank,
            directory=directory,
            mode=OpenMode.ATTACH,
            attach_timeout=attach_timeout_s,
            populate=False,
            unlink_on_cleanup=False,
        )
    except RegionResizedError:
        raise  # the right geometry, changed under us: its own message says so
    except RegionSizeMismatchError as exc:
        raise _geometry_mismatch(directory, instance_id, expected, _found(exc)) from exc
    try:
        # a region of more files whose first ones happen to match is another geometry too
        if layout.file_count <= MAX_SEGMENT_INDEX:
            extra = segment_file_name(instance_id, layout.file_count)
            if os.path.lexists(os.path.join(directory, extra)):
                found = f"the kvshm region has more files ({os.path.join(directory, extra)} too)"
                raise _geometry_mismatch(directory, instance_id, expected, found)
        _claim_rank(region, directory, instance_id, rank)
        if not region.is_fully_allocated():
            _allocate_own_cells(region)
    except BaseException:
        region.cleanup()
        raise
    return region


def _claim_rank(region: SharedOffloadRegion, directory: str, instance_id: str, rank: int) -> None:
    """Write-lock file 0's byte `rank` (an open file description lock on file 0's descriptor,
    which the region keeps until cleanup(); the kernel drops it when the process dies), or
    refuse: another engine's worker of this rank holds the region. The ranks of one engine
    lock different bytes. The lock is advisory (no read or write of the byte is kept out), so
    vLLM's own code never sees it, and OFD locks and flock do not interact, so the agent's
    holder probe sees this worker's shared flock as before."""
    fd = region.fileno()
    if try_lock_byte(fd, rank):
        return
    pid = byte_lock_holder_pid(fd, rank)
    holder = (
        f"process {pid}"
        if pid is not None
        else f"the kernel names no process for an open file description lock; 'fuser -v "
        f"{region.mmap_path}' lists those that map the file"
    )
    raise RegionServesAnotherEngine(
        f"the kvshm region with instanceId {instance_id!r} in {directory} already serves "
        f"another engine's worker of rank {rank} ({holder}): a region serves exactly one engine "
        f"per node. Give this engine its own OffloadRegion, or run one engine per node on it "
        f"(pod anti-affinity per node and maxSurge: 0, docs/deploy.md)."
    )


def _allocate_own_cells(region: SharedOffloadRegion) -> None:
    """Allocate this worker's cells of a sparse region (bounded: its own cells only), so that
    a tmpfs something else filled is a clear error here, not a SIGBUS in vLLM's first store."""
    own_bytes = sum(length for _, length in region.own_ranges())
    started = time.monotonic()
    try:
        region.populate()
    except RegionSpaceError as exc:
        raise RegionCellsOutOfSpace(
            f"{exc} The region is sparse (populate: false, or still populating), so worker "
            f"{region.rank} allocates its own {own_bytes} bytes of cells, and something filled "
            f"the tmpfs since the agent admitted it. Free space on the node, or use populate: "
            f"true (the default; docs/vllm-plugin.md)."
        ) from exc
    log.info(
        "kvshm: region %s was not fully allocated; allocated worker %d's %d bytes of cells in "
        "%.2f s",
        region.mmap_path,
        region.rank,
        own_bytes,
        time.monotonic() - started,
    )
