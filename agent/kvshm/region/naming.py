"""The region file's name: vLLM's, so vLLM's own code finds a kvshm region."""

from __future__ import annotations

import re

from kvshm.region.errors import InvalidInstanceIdError

FILE_PREFIX = "vllm_offload_"
FILE_SUFFIX = ".mmap"
MAX_INSTANCE_ID_LENGTH = 128

# Letters, digits, '.', '_' and '-', starting with a letter or digit: enough for vLLM's engine ids,
# Kubernetes object names and UUIDs, and never a path separator, a hidden file or a '..'.
INSTANCE_ID_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_INSTANCE_ID_RE = re.compile(INSTANCE_ID_PATTERN)
_REGION_FILE_RE = re.compile(
    re.escape(FILE_PREFIX) + f"({INSTANCE_ID_PATTERN})" + re.escape(FILE_SUFFIX)
)


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


def instance_id_from_file_name(file_name: str) -> str | None:
    """The instance id a region file name carries, or None if the name is not a region's."""
    match = _REGION_FILE_RE.fullmatch(file_name)
    if match is None or ".." in match.group(1):
        return None
    if len(match.group(1)) > MAX_INSTANCE_ID_LENGTH:
        return None
    return match.group(1)
