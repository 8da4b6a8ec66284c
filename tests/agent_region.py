"""Regions made and attached by kvshm's region library, for the tests that hand them to vLLM and
to the serving pod's scripts. The one place these tests call its constructor."""

from __future__ import annotations

from pathlib import Path

from kvshm.region import OpenMode, RegionFormat, RegionLayout, SharedOffloadRegion


def agent_made_region(
    directory: Path,
    instance_id: str,
    rows: int,
    cell: int,
    workers: int,
    *,
    populate: bool,
    region_format: RegionFormat = RegionFormat.VLLM_0_33,
    replicated: bool = False,
) -> SharedOffloadRegion:
    """The agent's way: created (never attached), sized, populated or not, left in place."""
    return SharedOffloadRegion(
        instance_id,
        RegionLayout(rows, cell, workers, format=region_format, replicated=replicated),
        directory=str(directory),
        mode=OpenMode.CREATE,
        populate=populate,
        unlink_on_cleanup=False,
    )


def attach_as_worker(
    directory: Path,
    instance_id: str,
    rows: int,
    cell: int,
    workers: int,
    rank: int,
    *,
    region_format: RegionFormat = RegionFormat.VLLM_0_33,
    replicated: bool = False,
) -> SharedOffloadRegion:
    """kvshm's attach of worker `rank` to an existing region, populating nothing."""
    return SharedOffloadRegion(
        instance_id,
        RegionLayout(rows, cell, workers, format=region_format, replicated=replicated),
        rank,
        directory=str(directory),
        mode=OpenMode.ATTACH,
        populate=False,
    )
