"""The index as a reader other than its engine finds it: the agent reads the outcome of the
last engine's start for the OffloadRegion's status (kvshm.agent.warmindex).

Pure Python: one pread of the header, parsed by kvshm.region.index.format. Never a mapping, a
lock or a write: the engine holds the file, and the tenant can change it at any moment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvshm.region import safefile
from kvshm.region.errors import UnsafePathError
from kvshm.region.index.format import HEADER_BYTES, Outcome, parse_header
from kvshm.region.naming import index_file_name


@dataclass(frozen=True)
class IndexReading:
    """What a reader other than the engine (the agent, for the region's status) finds of a
    region's index: nothing, the outcome of the last engine's start, or why it has none."""

    present: bool
    outcome: Outcome | None = None
    problem: str = ""  # why there is no outcome (present, outcome None)


def read_outcome(dir_fd: int, instance_id: str, directory: str) -> IndexReading:
    """The outcome block of the index of region `instance_id` in the directory open as
    `dir_fd` (`directory` only names it in messages): one pread of the header, never a mapping
    (the tenant could truncate it under a reader: SIGBUS), never a lock (the engine holds it),
    never a symlink, FIFO or hard-linked file (safefile). Never raises on what the file holds."""
    name = index_file_name(instance_id)
    path = os.path.join(directory, name)
    try:
        fd = safefile.open_checked(name, os.O_RDONLY, path, dir_fd)
    except FileNotFoundError:
        return IndexReading(False)
    except UnsafePathError as exc:
        return IndexReading(True, None, str(exc))
    except OSError as exc:
        return IndexReading(True, None, f"{path} cannot be opened ({exc.strerror})")
    try:
        data = os.pread(fd, HEADER_BYTES, 0)
    except OSError as exc:
        return IndexReading(True, None, f"{path} cannot be read ({exc.strerror})")
    finally:
        os.close(fd)
    header = parse_header(data)
    if header.outcome is not None:
        return IndexReading(True, header.outcome)
    return IndexReading(
        True,
        None,
        header.problem
        or "it holds no engine's outcome (an engine is starting, or the header was altered)",
    )
