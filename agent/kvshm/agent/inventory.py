"""The node inventory: every region under the root (all its files as one), whose it is, whether
it is held.

It is what the operator decides orphans from, so it errs on the safe side: a file that could not
be probed counts as held, and anything unsafe (a symlink or FIFO with a region file's name, a
hard-linked file) is reported as a problem, never opened.

What is published is bounded (published_files): tenants name the files in their directories, and
an OffloadNode too large for the API server would stop the node's status, heartbeat included.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

from kvshm.agent.errors import describe
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.root.regionfiles import describe_unsafe, files_of, find_region_files, is_held
from kvshm.agent.root.saferoot import RegionDir, RegionRoot
from kvshm.api import InvalidAddressError, InventoryFile, NodeInventory, RegionAddress
from kvshm.api.reading import MAX_INVENTORY_FILES, whole_seconds
from kvshm.region import UnsafePathError

# Bounds of the published status.files: the CRD's maxItems, and bytes of its JSON entries well
# under what etcd stores in one object (about 1.5 MiB, spec and the rest of the status included).
MAX_PUBLISHED_FILES = MAX_INVENTORY_FILES
MAX_PUBLISHED_BYTES = 512 << 10

ClaimLookup = Callable[[RegionAddress], str]
"""A region file's address -> key of the region that claims the file, or ""."""


@dataclass(frozen=True)
class RootScan:
    """One scan of the region root: the inventory published in the OffloadNode (less what the
    sink adds: heartbeat, version, reclaim results), and what only the agent shows."""

    root: str  # the region root's absolute path
    inventory: NodeInventory
    problems: tuple[str, ...] = ()  # unsafe or unexpected entries found under the root
    # paths whose regions were looked up by name besides the listing (the OffloadNode's
    # spec.retained and spec.reclaims): published first (published_files)
    looked_up: frozenset[str] = frozenset()
    huge_pages_wanted: bool = False  # a root without huge pages is a problem (--huge-pages)


class InventoryScanner:
    def __init__(
        self,
        root: RegionRoot,
        holds: HoldChecker,
        reserve_bytes: int,
        huge_pages_wanted: bool = False,
    ) -> None:
        self._root = root
        self._holds = holds
        self._reserve = reserve_bytes
        self._huge_pages_wanted = huge_pages_wanted
        # path -> when it was first seen an orphan: unclaimed and unheld (the operator's grace
        # period counts from it)
        self._orphaned_since: dict[str, datetime] = {}

    def seed_orphaned_since(self, since: dict[str, datetime]) -> None:
        """Carry orphaned-since times over a restart (from the last published inventory)."""
        for path, moment in since.items():
            self._orphaned_since.setdefault(path, moment)

    def scan(self, claimed_by: ClaimLookup, looked_up: Collection[str] = ()) -> RootScan:
        """looked_up: paths (<namespace>/<name>/<file>) whose regions are looked up by name
        as well as listed: a directory's listing is bounded (RegionDir.region_files), and the
        operator forgets a retained file it is not shown, so a tenant's junk must not hide it."""
        capacity, free = self._root.filesystem_bytes()
        files: list[InventoryFile] = []
        problems: list[str] = []
        wanted = _instances_by_directory(looked_up)
        for region_dir in self._root.walk(problems.append):
            wanted_here = wanted.get((region_dir.namespace, region_dir.name), set())
            files.extend(self._scan_dir(region_dir, claimed_by, problems, wanted_here))
        files = self._track_orphans(files)
        inventory = NodeInventory(
            capacity, free, self._reserve, tuple(files), pages=self._root.pages
        )
        return RootScan(
            self._root.path,
            inventory,
            tuple(problems),
            frozenset(looked_up),
            self._huge_pages_wanted,
        )

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
        self,
        region_dir: RegionDir,
        claimed_by: ClaimLookup,
        problems: list[str],
        wanted: Collection[str] = (),
    ) -> list[InventoryFile]:
        """One entry per region (all its files), named by its file 0, or by its first file
        when file 0 is gone; the regions of the `wanted` instance ids looked up by name
        where the bounded listing left them out."""
        found = []
        now = time.time()
        file_sets, unsafe = find_region_files(region_dir)
        listed = {file_set.instance_id for file_set in file_sets}
        seen = {entry.name for entry in unsafe}  # an id's names are no other id's
        for instance_id in sorted(set(wanted) - listed):
            file_set, unsafe_of_id = files_of(region_dir, instance_id)
            file_sets.extend([file_set] if file_set is not None else [])
            unsafe.extend(entry for entry in unsafe_of_id if entry.name not in seen)
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


def _instances_by_directory(paths: Iterable[str]) -> dict[tuple[str, str], set[str]]:
    """(namespace, name) -> instance ids of the region file paths among `paths` (others are
    no region's file, and are not looked up)."""
    wanted: dict[tuple[str, str], set[str]] = {}
    for path in paths:
        parsed = RegionAddress.from_relative_path(path)
        if parsed is not None:
            address, _ = parsed
            wanted.setdefault((address.namespace, address.name), set()).add(address.instance_id)
    return wanted


@dataclass(frozen=True)
class PublishedFiles:
    """The inventory entries published in the OffloadNode, and what was left out."""

    files: tuple[InventoryFile, ...]
    omitted: dict[str, int] = field(default_factory=dict)  # namespace -> entries left out

    @property
    def omitted_count(self) -> int:
        return sum(self.omitted.values())


def published_files(
    files: Iterable[InventoryFile],
    listed_first: Collection[str] = (),
    *,
    max_files: int = MAX_PUBLISHED_FILES,
    max_bytes: int = MAX_PUBLISHED_BYTES,
) -> PublishedFiles:
    """At most max_files entries of at most max_bytes (as JSON) in all, sorted by path.

    Files the operator decides from whether they are listed (listed_first: its spec.retained and
    spec.reclaims paths) come first. The rest is taken fairly: a round over the namespaces, each
    giving its next entry from a round over its region directories (a region's claimed file
    before the other names in its directory), so one tenant's junk cannot crowd out another's.
    """
    first = set(listed_first)
    found = list(files)
    chosen: list[InventoryFile] = []
    size = 0
    for file in itertools.chain(
        sorted((f for f in found if f.path in first), key=lambda f: f.path),
        _fair_order(f for f in found if f.path not in first),
    ):
        if len(chosen) == max_files or max_bytes - size < _SMALLEST_ENTRY_BYTES:
            break  # full: what is left is only counted
        entry_bytes = _entry_bytes(file)
        if size + entry_bytes <= max_bytes:
            chosen.append(file)
            size += entry_bytes
    kept = {f.path for f in chosen}
    omitted = Counter(_namespace(f) for f in found if f.path not in kept)
    return PublishedFiles(tuple(sorted(chosen, key=lambda f: f.path)), dict(omitted))


def _entry_bytes(file: InventoryFile) -> int:
    return len(json.dumps(file.to_status())) + 2  # and the separator


_SMALLEST_ENTRY_BYTES = _entry_bytes(InventoryFile("a/b/vllm_offload_c.mmap", 0, "", False))


def _namespace(file: InventoryFile) -> str:
    return file.path.split("/", 1)[0]


def _fair_order(files: Iterable[InventoryFile]) -> Iterator[InventoryFile]:
    by_dir: dict[str, dict[str, list[InventoryFile]]] = {}
    for file in files:
        namespace, name, _ = file.path.split("/", 2)
        by_dir.setdefault(namespace, {}).setdefault(name, []).append(file)
    namespaces = []
    for namespace in sorted(by_dir):
        directories = [
            sorted(entries, key=lambda f: (not f.claimed_by, f.path))
            for _, entries in sorted(by_dir[namespace].items())
        ]
        namespaces.append(_round_robin(directories))
    return _round_robin(namespaces)


def _round_robin(sources: Iterable[Iterable[InventoryFile]]) -> Iterator[InventoryFile]:
    """One item from each source in turn, until all are used up."""
    active = [iter(source) for source in sources]
    while active:
        still = []
        for source in active:
            item = next(source, None)
            if item is not None:
                yield item
                still.append(source)
        active = still
