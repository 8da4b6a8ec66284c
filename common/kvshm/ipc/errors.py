"""Errors kvshm.ipc raises on purpose; each says what went wrong and what to do."""

from __future__ import annotations


class IpcError(Exception):
    """Base class of every error kvshm.ipc raises on purpose."""


class RingConfigError(IpcError, ValueError):
    """A ring geometry, name, file mode or wait policy that cannot work."""


class RingFormatError(IpcError, OSError):
    """A file that is not a kvshm ring, a ring of another geometry than asked for, or a ring
    whose contents something other than kvshm wrote (a damaged message is skipped)."""


class MessageTooLargeError(RingFormatError):
    """A message larger than the reader's max_message_bytes; it was skipped, unread."""

    def __init__(self, path: str, size: int, limit: int) -> None:
        super().__init__(
            f"a message of {size} bytes arrived on ring {path}; this reader takes at most "
            f"{limit} bytes (max_message_bytes), so it skipped it without reading it. If the "
            f"writer really sends messages this large, attach with a larger max_message_bytes."
        )
        self.size = size
        self.limit = limit


class RoleBusyError(IpcError, RuntimeError):
    """The writer role or a reader slot is held by another live process."""


class RingTimeout(IpcError, TimeoutError):
    """A wait on the ring ran past its timeout; nothing was sent or consumed by the failed call."""


class WaitCancelled(IpcError):
    """A wait on the ring was cancelled through its cancel event."""


class ReaderDiedError(RingTimeout):
    """The writer is blocked on a reader whose process is gone, and no replacement re-joined."""

    def __init__(self, rank: int, who: str, path: str, grace_seconds: float) -> None:
        super().__init__(
            f"reader {rank} of ring {path} ({who}) died without reading its messages, and no "
            f"replacement joined within {grace_seconds:g} s; the message being sent was not "
            f"sent. Call evict_reader({rank}) to go on without it, or start a replacement: "
            f"MessageQueue.attach({path!r}, rank={rank})."
        )
        self.rank = rank
        self.who = who
        self.path = path


class WriterDiedError(IpcError, ConnectionError):
    """The ring's writer process is gone; a reader waiting for messages will get no more."""

    def __init__(self, path: str, who: str, grace_seconds: float, discarded_bytes: int = 0) -> None:
        partial = (
            f" The {discarded_bytes} bytes received of an unfinished message were discarded."
            if discarded_bytes
            else ""
        )
        super().__init__(
            f"the writer of ring {path} ({who}) has been gone for {grace_seconds:g} s.{partial} "
            f"Messages it finished were all delivered. Call dequeue again to wait for a "
            f"restarted writer (MessageQueue.resume_writer), or attach to the new ring."
        )
        self.path = path
        self.who = who
        self.grace_seconds = grace_seconds
        self.discarded_bytes = discarded_bytes


class ReaderEvictedError(IpcError, RuntimeError):
    """The writer evicted this reader's slot; it receives nothing more until it re-joins."""
