"""Attaching the agent's region for one worker: attach-only, checked against vLLM's geometry.

Everything the plugin knows about region files goes through attach_region, so a change of
kvshm.region's API is a change here only.
"""

from __future__ import annotations

import os

from kvshm.region import (
    RegionError,
    RegionFileMissingError,
    RegionSizeMismatchError,
    SharedOffloadRegion,
    segment_file_name,
)
from kvshm.region.naming import MAX_SEGMENT_INDEX
from kvshm.region.shared_region import OpenMode
from kvshm.vllm.geometry import RegionGeometry


class RegionGeometryMismatch(RegionError):
    """The agent's region does not have the geometry vLLM computed for this engine."""


def _mismatch(instance_id: str, expected: RegionGeometry, found: str) -> str:
    layout = expected.region_layout()
    names = ", ".join(f.name for f in layout.files(instance_id))
    return (
        f"vLLM computed a CPU offload region of {expected.describe()} for engine "
        f"{instance_id!r}, which vLLM 0.33 keeps in {layout.file_count} file"
        f"{'' if layout.file_count == 1 else 's'} ({names}), but {found}. The OffloadRegion "
        f"with instanceId {instance_id!r} must have {expected.offload_region_layout()} (see "
        f"'kvshm layout'), or change cpu_bytes_to_use/blocks_per_chunk in "
        f"kv_connector_extra_config to match the region."
    )


def _found(exc: RegionSizeMismatchError, expected: RegionGeometry) -> str:
    if isinstance(exc, RegionFileMissingError):
        return f"the kvshm region file {exc.path} is missing (the region has fewer files)"
    rows, rest = divmod(exc.actual_bytes, expected.row_stride)
    return (
        f"the kvshm region file {exc.path} is {exc.actual_bytes} bytes where vLLM expects "
        f"{exc.expected_bytes}"
        + (f" ({rows} rows of {expected.row_stride} bytes)" if not rest else "")
    )


def attach_region(
    directory: str,
    instance_id: str,
    expected: RegionGeometry,
    rank: int,
    attach_timeout_s: float,
) -> SharedOffloadRegion:
    """Map the agent's region (its files in `directory`, split as vLLM 0.33 splits them) for
    worker `rank`.

    Never creates, truncates, populates or removes a file; waits up to attach_timeout_s for the
    region to appear. The returned region holds a shared flock on file 0 (the agent counts it
    as a holder) until cleanup().
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
    except RegionSizeMismatchError as exc:
        found = _found(exc, expected)
        raise RegionGeometryMismatch(_mismatch(instance_id, expected, found)) from exc
    # a region of more files whose first ones happen to match is another geometry too
    if layout.file_count <= MAX_SEGMENT_INDEX:
        _refuse_extra_file(region, directory, instance_id, expected)
    return region


def _refuse_extra_file(
    region: SharedOffloadRegion, directory: str, instance_id: str, expected: RegionGeometry
) -> None:
    extra = os.path.join(directory, segment_file_name(instance_id, region.layout.file_count))
    if os.path.lexists(extra):
        region.cleanup()
        found = f"the kvshm region has more files ({extra} too)"
        raise RegionGeometryMismatch(_mismatch(instance_id, expected, found))
