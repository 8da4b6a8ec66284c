"""kvshm.ipc: a shared-memory ring buffer and message queue, one writer to N reader processes.

The agent broadcasts events (region ready, drain requested, agent restarted) to the worker
processes attached to a region. Pure Python and the standard library: no torch, no numpy.
"""

from kvshm.ipc.errors import (
    IpcError,
    MessageTooLargeError,
    ReaderDiedError,
    ReaderEvictedError,
    RingConfigError,
    RingFormatError,
    RingTimeout,
    RoleBusyError,
    WaitCancelled,
    WriterDiedError,
)
from kvshm.ipc.fence import FENCE_KIND
from kvshm.ipc.layout import RingLayout
from kvshm.ipc.queue import MessageQueue
from kvshm.ipc.reader import RingReader
from kvshm.ipc.ring import RingHandle, ShmRingBuffer
from kvshm.ipc.waiting import WaitPolicy
from kvshm.ipc.writer import RingWriter

__all__ = [
    "FENCE_KIND",
    "IpcError",
    "MessageQueue",
    "MessageTooLargeError",
    "ReaderDiedError",
    "ReaderEvictedError",
    "RingConfigError",
    "RingFormatError",
    "RingHandle",
    "RingLayout",
    "RingReader",
    "RingTimeout",
    "RingWriter",
    "RoleBusyError",
    "ShmRingBuffer",
    "WaitCancelled",
    "WaitPolicy",
    "WriterDiedError",
]
