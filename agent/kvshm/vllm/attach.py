"""Attaching the agent's region for one worker: attach-only, checked against vLLM's geometry.

Everything the plugin knows about region files goes through attach_region, so a change of
kvshm.region's API (region formats, segmented files) is a change here only.
"""

from __future__ import annotations

import os

from kvshm.region import RegionError, RegionSizeMismatchError, SharedOffloadRegion
from kvshm.region.shared_region import OpenMode
from kvshm.vllm.geometry import RegionGeometry


class RegionGeometryMismatch(RegionError):
    """The agent's region does not have the geometry vLLM computed for this engine."""


def _mismatch(path: str, instance_id: str, expected: RegionGeometry, found: str) -> str:
    return (
        f"vLLM computed a CPU offload region of {expected.describe()} for engine "
        f"{instance_id!r}, but the kvshm region {path} {found}. The OffloadRegion with "
        f"instanceId {instance_id!r} must have {expected.offload_region_layout()} (see "
        f"'kvshm layout'), or change cpu_bytes_to_use/blocks_per_chunk in "
        f"kv_connector_extra_config to match the region."
    )


def attach_region(
    directory: str,
    instance_id: str,
    expected: RegionGeometry,
    rank: int,
    attach_timeout_s: float,
) -> SharedOffloadRegion:
    """Map the agent's region `<directory>/vllm_offload_<instance_id>.mmap` for worker `rank`.

    Never creates, truncates, populates or removes the file; waits up to attach_timeout_s for
    it to appear. The returned region holds a shared flock on the file (the agent counts it as
    a holder) until cleanup().
    """
    path = os.path.join(directory, f"vllm_offload_{instance_id}.mmap")
    if expected.num_chunks < 1:
        raise RegionGeometryMismatch(
            f"vLLM computed no CPU offload chunks for engine {instance_id!r} (cpu_bytes_to_use "
            f"is below one row of {expected.row_stride} bytes): raise cpu_bytes_to_use"
        )
    if expected.is_padded:
        # this kvshm.region lays rows out unpadded; padded rows come with the region formats
        raise RegionGeometryMismatch(
            _mismatch(
                path,
                instance_id,
                expected,
                f"cannot be checked: vLLM pads each row of {expected.cpu_page_size} x "
                f"{expected.copies} bytes to {expected.row_stride}, and this kvshm version "
                f"attaches unpadded rows only",
            )
        )
    try:
        return SharedOffloadRegion(
            instance_id,
            expected.size_bytes,
            expected.num_chunks,
            expected.cell_rank(rank),
            expected.copies,
            expected.cpu_page_size,
            directory=directory,
            mode=OpenMode.ATTACH,
            attach_timeout=attach_timeout_s,
            populate=False,
            unlink_on_cleanup=False,
        )
    except RegionSizeMismatchError as exc:
        rows, rest = divmod(exc.actual_bytes, expected.row_stride)
        found = f"is {exc.actual_bytes} bytes" + (
            f" ({rows} rows of {expected.row_stride} bytes)" if not rest else ""
        )
        raise RegionGeometryMismatch(_mismatch(path, instance_id, expected, found)) from exc
