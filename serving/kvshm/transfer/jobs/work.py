"""A job's work as a timeline runs it: issued on a stream, holding what its copies read until
they are done. Backends make work, timelines run it, pinned tables are lent to it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

Stream = Any
"""A torch.cuda.Stream for GPU backends; None for the CPU backend."""


class Lease(ABC):
    """Something a job holds until its copies are done, then gives back for reuse."""

    __slots__ = ()

    @abstractmethod
    def release(self) -> None:
        """Called once, after the job's copies are done."""


Work = Callable[[Stream], object]
"""A job's copies: called once with the stream to issue them on; what it returns is kept
alive until the job is done, and released then if it is a Lease."""
