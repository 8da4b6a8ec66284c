"""A single-file region made the way the kvshm agent makes one: created (never attached), sized,
populated or not, and left in place when this process lets go of it."""

from __future__ import annotations

from pathlib import Path

from kvshm.region import OpenMode, SharedOffloadRegion


def agent_made_region(
    directory: Path, instance_id: str, rows: int, cell: int, workers: int, *, populate: bool
) -> SharedOffloadRegion:
    return SharedOffloadRegion(
        instance_id,
        rows * cell * workers,
        rows,
        None,
        workers,
        cell,
        directory=str(directory),
        mode=OpenMode.CREATE,
        populate=populate,
        unlink_on_cleanup=False,
    )
