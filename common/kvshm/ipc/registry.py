"""The ring's bookkeeping after the flags: who holds which role, join/leave requests.

Protocol (each array has one byte per reader; the reader writes its own request bytes, only
the writer writes acks, active and start positions):
- A reader that takes slot r writes kinds[r] (JOIN or LEAVE), fences, then bumps requests[r].
- The writer, between messages, carries out every request whose generation differs from
  acks[r]: JOIN marks every chunk read by r (so r never sees older messages), records the chunk
  it will write next as r's start, and sets active[r]; LEAVE marks every chunk read by r and
  clears active[r]. Then it fences and sets acks[r] to the request's generation.
- A joining reader waits until acks[r] equals its request, fences, and starts at start(r).

Idle readers sleep on the wake word (a futex): a reader sets sleepers[r], fences, looks at
its chunk once more and sleeps only if the wake word still holds the value it read before;
the writer bumps the wake word after each publication, fences, and wakes the word's sleepers
if any sleepers byte is set.

Slot records hold a pid, a host name and a chunk index, little-endian; they are for messages
and for a restarted writer (its cursor), not for liveness, which is the byte locks' job. The
writer's slot also holds, after its record, 1 + the chunk it last began to publish: a writer
that died after setting that chunk's written flag but before storing its cursor left the cursor
on a chunk the readers have already passed, and its successor must not write there again.
"""

from __future__ import annotations

import os
import struct

from kvshm.ipc.layout import RingLayout

JOIN = 1
LEAVE = 2
_RECORD = struct.Struct("<II48s")  # pid, chunk index (start or cursor), host name


def _identity(record: bytes) -> str:
    pid, _, host = _RECORD.unpack_from(record)
    if pid == 0:
        return "never held"
    name = host.rstrip(b"\0").decode(errors="replace")
    return f"pid {pid} on host {name}"


def _own_record(index: int) -> bytes:
    host = os.uname().nodename.encode()[:48]
    return _RECORD.pack(os.getpid(), index, host)


class Registry:
    """Typed views of the registry area of one mapped ring."""

    def __init__(self, buffer: memoryview, layout: RingLayout) -> None:
        n = layout.n_reader
        self.layout = layout
        self._buffer = buffer
        self.requests = buffer[layout.requests_offset : layout.requests_offset + n]
        self.kinds = buffer[layout.kinds_offset : layout.kinds_offset + n]
        self.acks = buffer[layout.acks_offset : layout.acks_offset + n]
        self.active = buffer[layout.active_offset : layout.active_offset + n]
        self.sleepers = buffer[layout.sleepers_offset : layout.sleepers_offset + n]
        self.wake_word = buffer[layout.wake_offset : layout.wake_offset + 4].cast("I")
        cursor = layout.writer_slot_offset + 4
        self.writer_cursor = buffer[cursor : cursor + 4].cast("I")
        publishing = layout.writer_slot_offset + _RECORD.size
        self.writer_publishing = buffer[publishing : publishing + 4].cast("I")

    def release(self) -> None:
        views = (self.requests, self.kinds, self.acks, self.active, self.sleepers)
        for view in (*views, self.wake_word, self.writer_cursor, self.writer_publishing):
            view.release()

    # -- reader slots ------------------------------------------------------------------------

    def reader_lock_offset(self, rank: int) -> int:
        return self.layout.reader_slot_offset(rank)

    def record_reader(self, rank: int) -> None:
        offset = self.layout.reader_slot_offset(rank)
        start = self.start(rank)
        self._buffer[offset : offset + _RECORD.size] = _own_record(start)

    def reader_identity(self, rank: int) -> str:
        offset = self.layout.reader_slot_offset(rank)
        return _identity(self._buffer[offset : offset + _RECORD.size].tobytes())

    def start(self, rank: int) -> int:
        offset = self.layout.reader_slot_offset(rank) + 4
        start: int = struct.unpack_from("<I", self._buffer, offset)[0]
        return start

    def set_start(self, rank: int, index: int) -> None:
        struct.pack_into("<I", self._buffer, self.layout.reader_slot_offset(rank) + 4, index)

    # -- the writer's slot -------------------------------------------------------------------

    @property
    def writer_lock_offset(self) -> int:
        return self.layout.writer_slot_offset

    def record_writer(self) -> None:
        offset = self.layout.writer_slot_offset
        self._buffer[offset : offset + _RECORD.size] = _own_record(self.writer_cursor[0])

    def writer_identity(self) -> str:
        offset = self.layout.writer_slot_offset
        return _identity(self._buffer[offset : offset + _RECORD.size].tobytes())
