"""A bounded walk of a directory whose contents someone else chose (a tenant's region directory,
what a serving pod left under the root): through descriptors, never following a symlink nor
entering another filesystem, looking at no more than so many entries and levels."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    path: str  # relative to the top, "/"-separated
    stat: os.stat_result  # the entry itself (a symlink is not followed)
    not_entered: str = ""  # a directory not walked into: why (a mount point, too deep, ...)


@dataclass(frozen=True)
class Walk:
    entries: tuple[Entry, ...]
    complete: bool  # False: there were more entries than the walk looks at


def walk(dir_fd: int, max_entries: int, max_depth: int) -> Walk:
    """Every entry below the open directory, parents before their children, at most
    max_entries of them; directories at max_depth levels below the top are not entered."""
    device = os.fstat(dir_fd).st_dev
    entries: list[Entry] = []
    complete = _walk(dir_fd, "", 0, device, max_entries, max_depth, entries)
    return Walk(tuple(entries), complete)


def _walk(
    dir_fd: int,
    prefix: str,
    depth: int,
    device: int,
    max_entries: int,
    max_depth: int,
    entries: list[Entry],
) -> bool:
    with os.scandir(dir_fd) as listing:
        for found in listing:
            if len(entries) == max_entries:
                return False
            try:
                st = found.stat(follow_symlinks=False)
            except FileNotFoundError:  # gone since it was listed
                continue
            path = prefix + found.name
            if not found.is_dir(follow_symlinks=False):
                entries.append(Entry(path, st))
                continue
            if depth >= max_depth:
                entries.append(Entry(path, st, f"deeper than {max_depth} levels"))
                continue
            try:
                child = os.open(
                    found.name,
                    os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                    dir_fd=dir_fd,
                )
            except OSError as exc:
                entries.append(Entry(path, st, exc.strerror or str(exc)))
                continue
            try:
                if os.fstat(child).st_dev != device:
                    entries.append(Entry(path, st, "a mount point"))
                    continue
                entries.append(Entry(path, st))
                if not _walk(child, path + "/", depth + 1, device, max_entries, max_depth, entries):
                    return False
            finally:
                os.close(child)
    return True
