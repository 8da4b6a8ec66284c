"""The reader side of the ring's flag protocol (vLLM's ShmRingBuffer), with joining and writer-death
detection."""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable

from kvshm.ipc.errors import (
    ReaderEvictedError,
    RingConfigError,
    RingFormatError,
    RoleBusyError,
    WriterDiedError,
)
from kvshm.ipc.fence import full_fence, load_fence, store_fence
from kvshm.ipc.futex import FUTEX_AVAILABLE, futex_wait
from kvshm.ipc.registry import JOIN, LEAVE
from kvshm.ipc.ring import ShmRingBuffer
from kvshm.ipc.waiting import CancelEvent, Waiter, WaitPolicy
from kvshm.region.locks import byte_is_locked, try_lock_byte


class RingReader:
    """Reader slot `rank` of a ring (rank=None: the first free slot). acquire() the next
    message's chunk, read it, release() it.

    Taking the slot posts a join request; the reader receives every message the writer
    starts after carrying it out (the first acquire() waits for that). A slot whose previous
    holder died is taken over the same way: that is how a replacement reader re-joins.
    """

    def __init__(
        self, ring: ShmRingBuffer, rank: int | None = None, policy: WaitPolicy | None = None
    ) -> None:
        self._ring = ring
        self._policy = policy or WaitPolicy()
        self._registry = registry = ring.registry
        self._lock_fd = ring.file.reopen()
        try:
            self.rank = self._take_slot(rank)
        except BaseException:
            os.close(self._lock_fd)
            raise
        # closing the descriptor drops the lock: on close(), on collection, or at exit
        self._release_role = weakref.finalize(self, os.close, self._lock_fd)
        registry.record_reader(self.rank)
        registry.sleepers[self.rank] = 0  # a dead predecessor may have died asleep
        self._me = 1 + self.rank
        self._chunks = ring.chunks
        self._flags = ring.flags
        self._index = 0
        self._joined = False
        self._generation = self._post(JOIN)

    @property
    def path(self) -> str:
        return self._ring.path

    def _take_slot(self, rank: int | None) -> int:
        n_reader = self._ring.n_reader
        if rank is not None:
            if not isinstance(rank, int) or not 0 <= rank < n_reader:
                raise RingConfigError(f"reader rank {rank!r} is not in 0..{n_reader - 1}")
            if try_lock_byte(self._lock_fd, self._registry.reader_lock_offset(rank)):
                return rank
            raise RoleBusyError(
                f"reader slot {rank} of ring {self.path} is held by a live reader "
                f"({self._registry.reader_identity(rank)}); take another slot (rank=None "
                f"takes the first free one) or stop that reader first"
            )
        for candidate in range(n_reader):
            if try_lock_byte(self._lock_fd, self._registry.reader_lock_offset(candidate)):
                return candidate
        raise RoleBusyError(
            f"all {n_reader} reader slots of ring {self.path} are held by live readers; "
            f"create the ring with more readers, or stop one"
        )

    def _post(self, kind: int) -> int:
        """Post a join or leave request; returns its generation."""
        registry = self._registry
        generation = (registry.requests[self.rank] + 1) % 256
        registry.kinds[self.rank] = kind
        store_fence()  # the kind before the generation that announces it
        registry.requests[self.rank] = generation
        return generation

    # -- the hot path ------------------------------------------------------------------------

    def acquire(
        self,
        timeout: float | None = None,
        cancel: CancelEvent | None = None,
        indefinite: bool = False,
    ) -> memoryview:
        """Wait for the next message's chunk and return it; release() it when done."""
        if self._ready():
            return self._chunks[self._index]
        return self._wait_readable(timeout, cancel, indefinite)

    def release(self) -> None:
        """Mark the acquired chunk read by this reader and move to the next one."""
        index = self._index
        load_fence()  # every load from the chunk before the flag that frees it
        self._flags[index][self._me] = 1
        index += 1
        if index == len(self._chunks):
            index = 0
        self._index = index

    # -- waiting -----------------------------------------------------------------------------

    def _poll_join(self) -> bool:
        """Whether the writer has carried out our join; on the first yes, take the start."""
        if not self._joined and self._registry.acks[self.rank] == self._generation:
            load_fence()  # the acknowledgement before the start position it publishes
            start = self._registry.start(self.rank)
            if start >= len(self._chunks):
                # not the writer's: someone else wrote the slot. Ask for a fresh start.
                self._generation = self._post(JOIN)
                raise RingFormatError(
                    f"reader {self.rank} of ring {self.path} was told to start at chunk "
                    f"{start}, but the ring has {len(self._chunks)} chunks: something other "
                    f"than kvshm wrote the ring. It asked the writer to join it again; the "
                    f"next call waits for that"
                )
            self._index = start
            self._joined = True
        return self._joined

    def _ready(self) -> bool:
        """Whether the current chunk holds a message this reader has not read."""
        if not self._joined and not self._poll_join():
            return False
        flags = self._flags[self._index]
        if flags[self._me]:
            return False
        load_fence()  # our read flag (cleared only after the writer filled) before written
        if not flags[0]:
            return False
        load_fence()  # both flags before any load from the chunk
        return True

    def _wait_readable(
        self, timeout: float | None, cancel: CancelEvent | None, indefinite: bool
    ) -> memoryview:
        def describe() -> str:
            what = f"chunk {self._index}" if self._joined else "the writer to accept its join"
            return f"reader {self.rank} of ring {self.path} waiting for {what}"

        waiter = Waiter(
            self._policy,
            describe,
            timeout=timeout,
            cancel=cancel,
            indefinite=indefinite,
            check=self._peer_check(),
            park=self._park,
        )
        while not self._ready():
            waiter.pause()
        return self._chunks[self._index]

    def _park(self, seconds: float) -> None:
        """Sleep up to `seconds`, or until the writer publishes (see registry's docstring)."""
        if not FUTEX_AVAILABLE:
            time.sleep(seconds)
            return
        sleepers = self._registry.sleepers
        seen = self._registry.wake_word[0]
        sleepers[self.rank] = 1
        full_fence()  # our mark before our last look; pairs with the writer's fence
        try:
            if not self._ready():
                futex_wait(self._ring.wake_address, seen, seconds)
        finally:
            sleepers[self.rank] = 0

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Wait until the writer has carried out this reader's join (the start-up handshake)."""

        def describe() -> str:
            return f"reader {self.rank} of ring {self.path} waiting for the writer to accept it"

        waiter = Waiter(
            self._policy, describe, timeout=timeout, check=self._peer_check(), park=self._park
        )
        while not self._poll_join():
            waiter.pause()

    def _peer_check(self) -> Callable[[float], None]:
        """A blocked reader's periodic check: still joined, and is the writer alive?"""
        dead_since: list[float] = []

        def check(now: float) -> None:
            if self.evicted():
                raise ReaderEvictedError(
                    f"the writer of ring {self.path} evicted reader {self.rank} (it took it "
                    f"for dead); close this reader and attach a new one to receive again"
                )
            if self.writer_alive():
                dead_since.clear()
                return
            if not dead_since:
                dead_since.append(now)
            grace = self._policy.peer_death_grace_seconds
            if now - dead_since[0] >= grace:
                raise WriterDiedError(self.path, self._registry.writer_identity(), grace)

        return check

    def writer_alive(self) -> bool:
        return byte_is_locked(self._lock_fd, self._registry.writer_lock_offset)

    def evicted(self) -> bool:
        """Whether the writer evicted this slot (and no newer request of ours is pending)."""
        registry = self._registry
        return (
            self._joined
            and registry.acks[self.rank] == self._generation
            and not registry.active[self.rank]
        )

    # -- cleanup ---------------------------------------------------------------------------

    def close(self) -> None:
        """Leave the ring: the writer stops waiting for this slot. Idempotent."""
        if self._release_role.alive:
            self._post(LEAVE)
            self._release_role()
