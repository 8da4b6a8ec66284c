"""The node inventory: every region under the root (all its files as one), whose it is, whether
it is held.

It is what the operator decides orphans from, so it errs on the safe side: a file that could not
be probed counts as held, and anything unsafe (a symlink or FIFO with a region file's name, a
hard-linked file) is reported as a problem, never opened.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from kvshm.agent.errors import describe
from kvshm.agent.holders import HoldChecker
from kvshm.agent.regionfiles import describe_unsafe, find_region_files, is_held
from kvshm.agent.saferoot import RegionDir, RegionRoot
from kvshm.api import InvalidAddressError, InventoryFile, NodeInventory, RegionAddress
from kvshm.api.reading import whole_seconds
from kvshm.region import UnsafePathError

ClaimLookup = Callable[[RegionAddress], str]
"""A region file's address -> key of the region that claims the file, or ""."""


@dataclass(frozen=True)
class RootScan:
    """One scan of the region root: the inventory published in the OffloadNode (less what the
    sink adds: heartbeat, version, reclaim results), and what only the agent shows."""

    root: str  # the region root's absolute path
    inventory: NodeInventory
    problems: tuple[str, ...] = ()  # unsafe or unexpected entries found under the root


class InventoryScanner:
    def __init__(self, root: RegionRoot, holds: HoldChecker, reserve_bytes: int) -> None:
        self._root = root
        self._holds = holds
        self._reserve = reserve_bytes
        # path -> when it was first seen an orphan: unclaimed and unheld (the operator's grace
        # period counts from it)
        self._orphaned_since: dict[str, datetime] = {}

    def seed_orphaned_since(self, since: dict[str, datetime]) -> None:
        """Carry orphaned-since times over a restart (from the last published inventory)."""
        for path, moment in since.items():
            self._orphaned_since.setdefault(path, moment)

    def scan(self, claimed_by: ClaimLookup) -> RootScan:
        capacity, free = self._root.filesystem_bytes()
        files: list[InventoryFile] = []
        problems: list[str] = []
        for region_dir in self._root.walk(problems.append):
            files.extend(self._scan_dir(region_dir, claimed_by, problems))
        files = self._track_orphans(files)
        inventory = NodeInventory(capacity, free, self._reserve, tuple(files))
        return RootScan(self._root.path, inventory, tuple(problems))

    def _track_orphans(self, files: list[InventoryFile]) -> list[InventoryFile]:
        # Rounded up to a whole second, as published: the grace period never starts early.
        now = whole_seconds(datetime.now(UTC) + timedelta(microseconds=999_999))
        orphans = {f.path for f in files if not f.claimed_by and not f.held}
        for path in list(self._orphaned_since):
            if path not in orphans:  # claimed or held again: its time starts over
                del self._orphaned_since[path]
        tracked = []
        for file in files:
            if file.path in orphans:
                since = self._orphaned_since.setdefault(file.path, now)
                file = replace(file, orphaned_since=since)
            tracked.append(file)
        return tracked

    def _scan_dir(
        self, region_dir: RegionDir, claimed_by: ClaimLookup, problems: list[str]
    ) -> list[InventoryFile]:
        """One entry per region (all its files), named by its file 0, or by its first file
        when file 0 is gone."""
        found = []
        now = time.time()
        file_sets, unsafe = find_region_files(region_dir)
        problems.extend(describe_unsafe(region_dir, entry) for entry in unsafe)
        for file_set in file_sets:
            path = region_dir.file_path(file_set.first_name)
            try:
                address = RegionAddress(region_dir.namespace, region_dir.name, file_set.instance_id)
            except InvalidAddressError as exc:
                problems.append(f"{path}: no region can have this file ({exc}); left untouched")
                continue
            try:
                held = is_held(self._holds, region_dir, file_set.names)
            except (UnsafePathError, OSError) as exc:
                problems.append(
                    f"{path}: could not probe holders ({describe(exc)}); counted as held"
                )
                held = True
            found.append(
                InventoryFile(
                    path=f"{address.directory}/{file_set.first_name}",
                    size_bytes=file_set.size_bytes,
                    claimed_by=claimed_by(address),
                    held=held,
                    age_seconds=int(max(0.0, now - file_set.newest_mtime)),
                    files=len(file_set.files),
                )
            )
        return found
