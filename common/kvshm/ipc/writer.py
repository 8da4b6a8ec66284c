"""The writer side of the ring's flag protocol (vLLM's ShmRingBuffer), with joins, leaves and
dead-reader detection."""

from __future__ import annotations

import logging
import os
import weakref
from typing import Literal

from kvshm.ipc.errors import ReaderDiedError, RingConfigError, RoleBusyError
from kvshm.ipc.fence import copy_fence, full_fence, load_fence, store_fence
from kvshm.ipc.futex import futex_wake_all
from kvshm.ipc.registry import JOIN
from kvshm.ipc.ring import ShmRingBuffer
from kvshm.ipc.waiting import CancelEvent, Waiter, WaitPolicy
from kvshm.region.locks import byte_is_locked, try_lock_byte

log = logging.getLogger(__name__)

DeadReaderAction = Literal["raise", "evict"]


class RingWriter:
    """The one writer of a ring. acquire() a chunk, fill it, publish() it.

    Only readers that have joined are waited for; a reader receives the messages whose
    acquire() came after the writer carried out its join. A joined reader that dies blocks the
    writer until a replacement joins its slot or peer_death_grace_seconds pass; then the
    writer raises ReaderDiedError (on_dead_reader="raise") or evicts it and goes on ("evict").
    The grace period runs from when the writer first found the reader dead, across calls: a
    writer whose every send times out sooner still evicts (or raises) once it has passed.
    A writer restarted on an existing ring (its predecessor died) continues at the chunk its
    predecessor would have written next, also when the predecessor died inside publish().
    """

    def __init__(
        self,
        ring: ShmRingBuffer,
        policy: WaitPolicy | None = None,
        *,
        on_dead_reader: DeadReaderAction = "raise",
    ) -> None:
        if on_dead_reader not in ("raise", "evict"):
            raise RingConfigError(f"on_dead_reader must be 'raise' or 'evict': {on_dead_reader!r}")
        self._ring = ring
        self._policy = policy or WaitPolicy()
        self._on_dead_reader = on_dead_reader
        self._registry = registry = ring.registry
        self._lock_fd = ring.file.reopen()
        if not try_lock_byte(self._lock_fd, registry.writer_lock_offset):
            os.close(self._lock_fd)
            raise RoleBusyError(
                f"ring {ring.path} already has a writer ({registry.writer_identity()}); a ring "
                f"has one writer at a time: stop that one first, or use another ring"
            )
        # closing the descriptor drops the lock: on close(), on collection, or at exit
        self._release_role = weakref.finalize(self, os.close, self._lock_fd)
        self._chunks = ring.chunks
        self._flags = ring.flags
        self._reads = ring.read_flags
        self._cursor = registry.writer_cursor
        self._publishing = registry.writer_publishing
        self._index = self._resume_index()
        registry.record_writer()
        # reader rank -> when this writer, blocked on it, first found it dead
        self._dead_since: dict[int, float] = {}
        self._wake_word = registry.wake_word
        self._sleepers = registry.sleepers
        self._nobody_asleep = bytes(ring.n_reader)
        self._requests = registry.requests
        self._acked = registry.acks.tobytes()
        self._all_read = b"\x01" * ring.n_reader
        self._fresh = self._fresh_read_flags()
        self._serve_requests()

    @property
    def path(self) -> str:
        return self._ring.path

    def _resume_index(self) -> int:
        """The chunk to write next: the cursor, or the chunk after it if a predecessor died
        inside publish() after setting that chunk's written flag (the readers may have read
        it already; writing there again would deliver the next message a lap late)."""
        cursor = self._cursor[0] % len(self._chunks)
        if self._publishing[0] == cursor + 1 and self._flags[cursor][0]:
            cursor = (cursor + 1) % len(self._chunks)
            self._cursor[0] = cursor
        return cursor

    # -- the hot path ------------------------------------------------------------------------

    def acquire(
        self, timeout: float | None = None, cancel: CancelEvent | None = None
    ) -> memoryview:
        """Wait until the current chunk is free, clear its written flag, return it to fill."""
        if self._requests != self._acked:
            self._serve_requests()
        index = self._index
        flags = self._flags[index]
        if flags[0] and self._reads[index] != self._all_read:
            self._wait_writable(index, timeout, cancel)
        load_fence()  # the flag loads above come before any store into the chunk
        flags[0] = 0
        return self._chunks[index]

    def publish(self) -> None:
        """Hand the filled chunk to the readers and move to the next one."""
        index = self._index
        copy_fence()  # the chunk's bytes before the cleared read flags
        self._reads[index][:] = self._fresh
        self._publishing[0] = index + 1  # for a successor, should this process die from here
        store_fence()  # the cleared read flags and publishing mark before written = 1
        self._flags[index][0] = 1
        index += 1
        if index == len(self._chunks):
            index = 0
        self._index = index
        self._cursor[0] = index
        self._wake_readers()

    def _wake_readers(self) -> None:
        """Bump the wake word; wake the readers sleeping on it, if any (registry docstring)."""
        word = self._wake_word
        word[0] = (word[0] + 1) & 0xFFFFFFFF
        full_fence()  # written = 1 and the new word before looking for sleepers
        if self._sleepers != self._nobody_asleep:
            futex_wake_all(self._ring.wake_address)

    # -- waiting -----------------------------------------------------------------------------

    def _blockers(self, index: int) -> list[int]:
        return [rank for rank, done in enumerate(self._reads[index].tobytes()) if not done]

    def _wait_writable(self, index: int, timeout: float | None, cancel: CancelEvent | None) -> None:
        flags, reads = self._flags[index], self._reads[index]
        dead_since = self._dead_since

        def describe() -> str:
            return (
                f"writer of ring {self.path} waiting for readers {self._blockers(index)} to "
                f"read chunk {index}"
            )

        grace = self._policy.peer_death_grace_seconds

        def check(now: float) -> None:
            for rank in self._blockers(index):
                if self._reader_alive(rank):
                    dead_since.pop(rank, None)
                elif now - dead_since.setdefault(rank, now) >= grace:
                    self._dead_reader(rank)

        waiter = Waiter(self._policy, describe, timeout=timeout, cancel=cancel, check=check)
        while True:
            if self._requests != self._acked:
                self._serve_requests()
            if not flags[0] or reads == self._all_read:
                return
            waiter.pause()

    def _reader_alive(self, rank: int) -> bool:
        return byte_is_locked(self._lock_fd, self._registry.reader_lock_offset(rank))

    def _dead_reader(self, rank: int) -> None:
        who = self._registry.reader_identity(rank)
        if self._on_dead_reader == "evict":
            log.warning("ring %s: reader %d (%s) died; evicting it", self.path, rank, who)
            self.evict_reader(rank)
            return
        raise ReaderDiedError(rank, who, self.path, self._policy.peer_death_grace_seconds)

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait until every reader slot has joined (the start-up handshake)."""
        active = self._registry.active

        def describe() -> str:
            missing = [rank for rank, on in enumerate(active.tobytes()) if not on]
            return f"writer of ring {self.path} waiting for readers {missing} to join"

        waiter = Waiter(self._policy, describe, timeout=timeout)
        while True:
            self._serve_requests()
            if all(active.tobytes()):
                return
            waiter.pause()

    # -- joins, leaves and evictions ---------------------------------------------------------

    def _fresh_read_flags(self) -> bytes:
        """Read flags of a newly written chunk: 0 for joined readers, 1 for empty slots."""
        return bytes(1 - on for on in self._registry.active.tobytes())

    def _serve_requests(self) -> None:
        registry = self._registry
        requests = self._requests.tobytes()
        for rank, (asked, done) in enumerate(zip(requests, self._acked, strict=True)):
            if asked == done:
                continue
            load_fence()  # the request generation before its kind
            self._ring.mark_read_everywhere(rank)
            self._dead_since.pop(rank, None)  # a new holder, or none: no one to wait for
            if registry.kinds[rank] == JOIN:
                registry.set_start(rank, self._index)
                registry.active[rank] = 1
            else:
                registry.active[rank] = 0
            store_fence()  # start position and flags before the acknowledgement
            registry.acks[rank] = asked
        self._acked = requests
        self._fresh = self._fresh_read_flags()
        self._wake_readers()  # joining readers may be asleep waiting for their ack

    def evict_reader(self, rank: int) -> None:
        """Stop waiting for reader `rank` (e.g. after ReaderDiedError). A replacement reader
        re-joins the slot by attaching with rank=rank."""
        if not 0 <= rank < self._ring.n_reader:
            raise RingConfigError(f"reader rank {rank} is not in 0..{self._ring.n_reader - 1}")
        self._ring.mark_read_everywhere(rank)
        self._dead_since.pop(rank, None)
        self._registry.active[rank] = 0
        self._registry.sleepers[rank] = 0  # a dead reader may have died asleep
        self._fresh = self._fresh_read_flags()

    def joined_readers(self) -> list[int]:
        self._serve_requests()
        return [rank for rank, on in enumerate(self._registry.active.tobytes()) if on]

    # -- cleanup ---------------------------------------------------------------------------

    def close(self) -> None:
        """Give up the writer role (a new writer may then resume the ring). Idempotent."""
        self._release_role()
