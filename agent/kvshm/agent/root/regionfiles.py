"""All files of one region in a region directory, handled as one: found, probed, removed together.

A vllm-0.33 region is up to 32 files (vllm_offload_<id>.mmap, .mmap.1, ...). The agent groups
the names in a directory by instance id; a group is held when any of its files is, and it is
removed only while the agent holds every one of its files exclusively (so no kvshm attacher can
start meanwhile: attachers flock file 0, and file 0 goes first). Files left without their file 0
belong to no region anyone can attach, and are orphans like any other.

A tenant can fill its directory with region-shaped names: listing all regions of a directory
reads a bounded number of them (RegionDir.region_files); the files of one known instance id are
looked up by their at most 32 names, so no number of other names hides them.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass

from kvshm.agent.root.holders import FileCheck, HoldChecker
from kvshm.agent.root.saferoot import RegionDir
from kvshm.region import RegionFileName
from kvshm.region.naming import MAX_SEGMENT_INDEX, index_file_name, segment_file_name
from kvshm.region.safefile import check_regular, describe_file_type


@dataclass(frozen=True)
class FoundFile:
    name: str
    segment: int
    stat: os.stat_result


@dataclass(frozen=True)
class RegionFileSet:
    """The files of one instance id found in one directory, file 0 (if any) first."""

    instance_id: str
    files: tuple[FoundFile, ...]

    @property
    def names(self) -> list[str]:
        return [file.name for file in self.files]

    @property
    def first_name(self) -> str:
        """File 0's name, or the lowest segment's when file 0 is missing."""
        return self.files[0].name

    @property
    def has_file_0(self) -> bool:
        return self.files[0].segment == 0

    @property
    def size_bytes(self) -> int:
        return sum(file.stat.st_size for file in self.files)

    @property
    def allocated_bytes(self) -> int:
        return sum(file.stat.st_blocks * 512 for file in self.files)

    @property
    def newest_mtime(self) -> float:
        return max(file.stat.st_mtime for file in self.files)


def describe_unsafe(region_dir: RegionDir, entry: FoundFile) -> str:
    st = entry.stat
    links = f" with {st.st_nlink} links" if stat.S_ISREG(st.st_mode) else ""
    return (
        f"{region_dir.file_path(entry.name)} is {describe_file_type(st.st_mode)}{links}, not a "
        f"region file; left untouched"
    )


def find_region_files(region_dir: RegionDir) -> tuple[list[RegionFileSet], list[FoundFile]]:
    """Every region's files in the directory (a bounded listing: RegionDir.region_files), and
    the region-named entries that are not plain single-link files (left out, never opened)."""
    return _group(region_dir, region_dir.region_files())


def files_of(
    region_dir: RegionDir, instance_id: str
) -> tuple[RegionFileSet | None, list[FoundFile]]:
    """instance_id's files in the directory (None if there are none) and the unsafe entries,
    found by looking up each name a file of the id can have."""
    names = (
        (segment_file_name(instance_id, segment), RegionFileName(instance_id, segment))
        for segment in range(MAX_SEGMENT_INDEX + 1)
    )
    found, problems = _group(region_dir, names)
    return (found[0] if found else None), problems


def _group(
    region_dir: RegionDir, names: Iterable[tuple[str, RegionFileName]]
) -> tuple[list[RegionFileSet], list[FoundFile]]:
    grouped: dict[str, list[FoundFile]] = {}
    unsafe = []
    for name, parsed in names:
        st = region_dir.lstat(name)
        if st is None:
            continue
        entry = FoundFile(name, parsed.segment, st)
        if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
            grouped.setdefault(parsed.instance_id, []).append(entry)
        else:
            unsafe.append(entry)
    found = [
        RegionFileSet(iid, tuple(sorted(files, key=lambda f: f.segment)))
        for iid, files in sorted(grouped.items())
    ]
    return found, unsafe


@contextlib.contextmanager
def holding_all(
    holds: HoldChecker,
    region_dir: RegionDir,
    names: list[str],
    checks: Mapping[str, FileCheck] | None = None,
) -> Iterator[dict[str, int] | None]:
    """Yields {name: descriptor holding it exclusively} for every file still there, or None
    when some process holds any of them. File 0 comes first in `names`, so attachers stop
    before the others are probed. Each file must pass its check in `checks` (by default: a
    regular single-link file). Keep the block short."""
    with contextlib.ExitStack() as stack:
        held: dict[str, int] = {}
        for name in names:
            try:
                check = checks.get(name, check_regular) if checks else check_regular
                fd = stack.enter_context(
                    holds.exclusive(region_dir.fd, name, region_dir.file_path(name), check)
                )
            except FileNotFoundError:
                continue
            if fd is None:
                yield None
                return
            held[name] = fd
        yield held


def is_held(holds: HoldChecker, region_dir: RegionDir, names: list[str]) -> bool:
    with holding_all(holds, region_dir, names) as held:
        return held is None


def unlink_held(
    region_dir: RegionDir, held: dict[str, int], linked_ok: Collection[str] = ()
) -> list[str]:
    """Remove each file held (by the descriptors holding_all gave), file 0 first; what could
    not be removed, and why. Names in `linked_ok` may have more hard links (the caller knows
    the inode is its own)."""
    problems = []
    for name, fd in held.items():
        problem = region_dir.unlink_regular(name, os.fstat(fd), linked_ok=name in linked_ok)
        if problem:
            problems.append(problem)
    return problems


def unlink_unheld(
    region_dir: RegionDir, names: list[str], linked_ok: Collection[str] = ()
) -> list[str]:
    """Remove the files although a process holds them (a drain's grace period is over)."""
    problems = []
    for name in names:
        problem = region_dir.unlink_regular(name, linked_ok=name in linked_ok)
        if problem:
            problems.append(problem)
    return problems


def remove_index(region_dir: RegionDir, instance_id: str) -> list[str]:
    """Remove the region's warm-restart index (vllm_offload_<id>.index, which the engine's
    scheduler writes beside the region: docs/warm-restart.md) with the region's files; what
    could not be removed, and why (a symlink, FIFO or hard-linked file there is left alone).
    Nothing holds it: the engine locks a byte of it, never flocks it."""
    name = index_file_name(instance_id)
    if region_dir.lstat(name) is None:
        return []
    problem = region_dir.unlink_regular(name)
    return [problem] if problem else []
