"""kvshm.region: vLLM's shared CPU offload region, created or attached safely, populated, locked."""

from kvshm.region.errors import (
    InvalidInstanceIdError,
    InvalidLayoutError,
    RegionAttachTimeout,
    RegionError,
    RegionExtraFileError,
    RegionFileExistsError,
    RegionFileMissingError,
    RegionLockError,
    RegionResizedError,
    RegionSizeMismatchError,
    RegionSpaceError,
    UnsafePathError,
)
from kvshm.region.layout import RegionFile, RegionFormat, RegionLayout
from kvshm.region.naming import (
    INSTANCE_ID_PATTERN,
    MAX_INSTANCE_ID_LENGTH,
    RegionFileName,
    instance_id_from_file_name,
    parse_region_file_name,
    region_file_name,
    segment_file_name,
    validate_instance_id,
)
from kvshm.region.populate import PopulateMethod
from kvshm.region.shared_region import OpenMode, SharedOffloadRegion, pin_mmap_region

__all__ = [
    "INSTANCE_ID_PATTERN",
    "MAX_INSTANCE_ID_LENGTH",
    "InvalidInstanceIdError",
    "InvalidLayoutError",
    "OpenMode",
    "PopulateMethod",
    "RegionAttachTimeout",
    "RegionError",
    "RegionExtraFileError",
    "RegionFile",
    "RegionFileExistsError",
    "RegionFileMissingError",
    "RegionFileName",
    "RegionFormat",
    "RegionLayout",
    "RegionLockError",
    "RegionResizedError",
    "RegionSizeMismatchError",
    "RegionSpaceError",
    "SharedOffloadRegion",
    "UnsafePathError",
    "instance_id_from_file_name",
    "parse_region_file_name",
    "pin_mmap_region",
    "region_file_name",
    "segment_file_name",
    "validate_instance_id",
]
