"""What a tenant that can write a ring file does to it, outside kvshm."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def scribbling_on(path: str) -> Iterator[mmap.mmap]:
    """The ring file mapped shared and writable, the way any process with write access can."""
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    try:
        yield mapping
    finally:
        mapping.close()
