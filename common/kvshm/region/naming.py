"""Region file names: vLLM's, so vLLM's own code finds a kvshm region.

File 0 of a region is vllm_offload_<id>.mmap; vLLM 0.33 puts further rows in
vllm_offload_<id>.mmap.1, .2, ... (at most 32 files). Every name of a region carries its id, so
all files of one region in a directory are found by grouping names by instance id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvshm.region.errors import InvalidInstanceIdError

FILE_PREFIX = "vllm_offload_"
FILE_SUFFIX = ".mmap"
INDEX_SUFFIX = ".index"  # the warm-restart index beside a region (kvshm.region.index)
MAX_INSTANCE_ID_LENGTH = 128
MAX_SEGMENTS = 32  # vLLM 0.33's CPUOffloadingSpec splits a region over at most this many files
MAX_SEGMENT_INDEX = MAX_SEGMENTS - 1

# Letters, digits, '.', '_' and '-', starting with a letter or digit: enough for vLLM's engine ids,
# Kubernetes object names and UUIDs, and never a path separator, a hidden file or a '..'.
INSTANCE_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_INSTANCE_ID_RE = re.compile(INSTANCE_ID_PATTERN)
# ".mmap" ends file 0; ".mmap.<i>" (no leading zero) file i. The id cannot swallow a ".mmap.<i>"
# ending, because every name must still end in ".mmap" or ".mmap.<digits>" after it.
_REGION_FILE_RE = re.compile(
    re.escape(FILE_PREFIX)
    + f"({INSTANCE_ID_PATTERN})"
    + re.escape(FILE_SUFFIX)
    + r"(?:\.([1-9][0-9]?))?"
)


@dataclass(frozen=True)
class RegionFileName:
    """What a region file's name says: whose region it is and which of its files."""

    instance_id: str
    segment: int  # 0 for vllm_offload_<id>.mmap, i for vllm_offload_<id>.mmap.<i>


def validate_instance_id(instance_id: str) -> str:
    """Return the id unchanged, or raise InvalidInstanceIdError saying what is wrong with it."""
    if not isinstance(instance_id, str):
        raise InvalidInstanceIdError(
            f"instance id must be a string, got {type(instance_id).__name__}"
        )
    if not instance_id:
        raise InvalidInstanceIdError("instance id is empty: give the engine's instance id")
    if len(instance_id) > MAX_INSTANCE_ID_LENGTH:
        raise InvalidInstanceIdError(
            f"instance id is {len(instance_id)} characters long; at most "
            f"{MAX_INSTANCE_ID_LENGTH} are allowed"
        )
    if ".." in instance_id or not _INSTANCE_ID_RE.fullmatch(instance_id):
        raise InvalidInstanceIdError(
            f"instance id {instance_id!r} is not allowed: use letters, digits, '.', '_' and '-', "
            f"start with a letter or digit, and do not use '..'"
        )
    return instance_id


def region_file_name(instance_id: str) -> str:
    """vLLM's file name for the region of an engine instance: vllm_offload_<id>.mmap."""
    return f"{FILE_PREFIX}{validate_instance_id(instance_id)}{FILE_SUFFIX}"


def segment_file_name(instance_id: str, segment: int) -> str:
    """vLLM's name for file `segment` of a region: file 0 has no suffix, file i ends in .<i>."""
    if isinstance(segment, bool) or not isinstance(segment, int):
        raise ValueError(f"segment must be an integer, got {segment!r}")
    if not 0 <= segment <= MAX_SEGMENT_INDEX:
        raise ValueError(f"segment must be in [0, {MAX_SEGMENT_INDEX}], got {segment}")
    name = region_file_name(instance_id)
    return f"{name}.{segment}" if segment else name


def index_file_name(instance_id: str) -> str:
    """The warm-restart index beside a region (docs/warm-restart.md): vllm_offload_<id>.index,
    the region's name with its own suffix, so it goes wherever the region's files go."""
    return f"{FILE_PREFIX}{validate_instance_id(instance_id)}{INDEX_SUFFIX}"


def parse_index_file_name(file_name: str) -> str | None:
    """The instance id whose warm-restart index `file_name` is, or None if it is none's."""
    if not (file_name.startswith(FILE_PREFIX) and file_name.endswith(INDEX_SUFFIX)):
        return None
    instance_id = file_name[len(FILE_PREFIX) : -len(INDEX_SUFFIX)]
    try:
        return validate_instance_id(instance_id)
    except InvalidInstanceIdError:
        return None


def parse_region_file_name(file_name: str) -> RegionFileName | None:
    """Instance id and segment of any file of a region, or None if the name is no region's."""
    match = _REGION_FILE_RE.fullmatch(file_name)
    if match is None or ".." in match.group(1):
        return None
    if len(match.group(1)) > MAX_INSTANCE_ID_LENGTH:
        return None
    segment = int(match.group(2) or 0)
    if segment > MAX_SEGMENT_INDEX:
        return None
    return RegionFileName(match.group(1), segment)


def instance_id_from_file_name(file_name: str) -> str | None:
    """The instance id file 0 of a region carries, or None if the name is not a file 0's."""
    parsed = parse_region_file_name(file_name)
    return parsed.instance_id if parsed is not None and parsed.segment == 0 else None
