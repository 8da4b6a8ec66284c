"""Regions made and attached by kvshm's region library, for the tests that hand them to vLLM and
to the serving pod's scripts. The one place these tests call its constructor."""

from __future__ import annotations

from pathlib import Path

from kvshm.region import OpenMode, RegionLayout, SharedOffloadRegion


def agent_made_region(
    directory: Path, instance_id: str, layout: RegionLayout, *, populate: bool
) -> SharedOffloadRegion:
    """The agent's way: created (never attached), sized, populated or not, left in place."""
    return SharedOffloadRegion(
        instance_id,
        layout,
        directory=str(directory),
        mode=OpenMode.CREATE,
        populate=populate,
        unlink_on_cleanup=False,
    )


def attach_as_worker(
    directory: Path, instance_id: str, layout: RegionLayout, rank: int
) -> SharedOffloadRegion:
    """kvshm's attach of worker `rank` to an existing region, populating nothing."""
    return SharedOffloadRegion(
        instance_id,
        layout,
        rank,
        directory=str(directory),
        mode=OpenMode.ATTACH,
        populate=False,
    )
