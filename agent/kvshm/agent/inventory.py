"""The node inventory: every region-shaped file under the root, whose it is, whether it is held.

It is what the operator decides orphans from, so it errs on the safe side: a file that could not
be probed counts as held, and anything unsafe (a symlink or FIFO with a region file's name, a
hard-linked file) is reported as a problem, never opened.
"""

from __future__ import annotations

import stat
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import UTC, datetime

from kvshm.agent.errors import describe
from kvshm.agent.holders import HoldChecker
from kvshm.agent.reports import InventoryFile, NodeInventory
from kvshm.agent.saferoot import RegionDir, RegionRoot
from kvshm.region import UnsafePathError
from kvshm.region.safefile import describe_file_type

ClaimLookup = Callable[[str, str, str], str]
"""(namespace, name, instance id) -> key of the region that claims the file, or ""."""


class InventoryScanner:
    def __init__(self, root: RegionRoot, holds: HoldChecker, reserve_bytes: int) -> None:
        self._root = root
        self._holds = holds
        self._reserve = reserve_bytes
        # path -> when it was first seen unclaimed (the operator's grace period counts from it)
        self._unclaimed_since: dict[str, datetime] = {}

    def seed_unclaimed_since(self, since: dict[str, datetime]) -> None:
        """Carry first-seen times over a restart (from the last published inventory)."""
        for path, moment in since.items():
            self._unclaimed_since.setdefault(path, moment)

    def scan(self, claimed_by: ClaimLookup) -> NodeInventory:
        capacity, free = self._root.filesystem_bytes()
        files: list[InventoryFile] = []
        problems: list[str] = []
        for region_dir in self._root.walk(problems.append):
            files.extend(self._scan_dir(region_dir, claimed_by, problems))
        files = self._track_unclaimed(files)
        return NodeInventory(
            self._root.path, capacity, free, self._reserve, tuple(files), tuple(problems)
        )

    def _track_unclaimed(self, files: list[InventoryFile]) -> list[InventoryFile]:
        now = datetime.now(UTC)
        unclaimed = {f.path for f in files if not f.claimed_by}
        for path in list(self._unclaimed_since):
            if path not in unclaimed:
                del self._unclaimed_since[path]
        tracked = []
        for file in files:
            if file.path in unclaimed:
                since = self._unclaimed_since.setdefault(file.path, now)
                file = replace(file, first_seen_unclaimed=since)
            tracked.append(file)
        return tracked

    def _scan_dir(
        self, region_dir: RegionDir, claimed_by: ClaimLookup, problems: list[str]
    ) -> list[InventoryFile]:
        found = []
        now = time.time()
        for file_name, instance_id in region_dir.region_files():
            path = region_dir.file_path(file_name)
            st = region_dir.lstat(file_name)
            if st is None:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                links = f" with {st.st_nlink} links" if stat.S_ISREG(st.st_mode) else ""
                problems.append(
                    f"{path} is {describe_file_type(st.st_mode)}{links}, not a region file; "
                    f"left untouched"
                )
                continue
            try:
                held = self._holds.is_held(region_dir.fd, file_name, path)
            except FileNotFoundError:
                continue
            except (UnsafePathError, OSError) as exc:
                problems.append(
                    f"{path}: could not probe holders ({describe(exc)}); counted as held"
                )
                held = True
            found.append(
                InventoryFile(
                    path=f"{region_dir.namespace}/{region_dir.name}/{file_name}",
                    size_bytes=st.st_size,
                    allocated_bytes=st.st_blocks * 512,
                    claimed_by=claimed_by(region_dir.namespace, region_dir.name, instance_id),
                    held=held,
                    age_seconds=max(0.0, now - st.st_mtime),
                )
            )
        return found
