"""MessageQueue: pickled Python objects from one writer to every reader (vLLM's MessageQueue
semantics)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvshm.ipc.codec import (
    CONTINUATION,
    FIRST,
    FRAGMENT,
    MAX_MESSAGE_BYTES,
    OOB_THRESHOLD,
    FragmentAssembler,
    MessageEncoder,
    PieceCursor,
    check_max_message_bytes,
    decode,
)
from kvshm.ipc.errors import IpcError, WriterDiedError
from kvshm.ipc.layout import RingLayout
from kvshm.ipc.reader import RingReader
from kvshm.ipc.ring import DEFAULT_ATTACH_TIMEOUT_SECONDS, RingHandle, ShmRingBuffer
from kvshm.ipc.ringfile import DEFAULT_DIRECTORY, DEFAULT_FILE_MODE
from kvshm.ipc.waiting import CancelEvent, WaitPolicy
from kvshm.ipc.writer import DeadReaderAction, RingWriter

DEFAULT_MAX_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_CHUNKS = 16
Role = TypeVar("Role", RingWriter, RingReader)


def _role_or_close(ring: ShmRingBuffer, make: Callable[[], Role]) -> Role:
    """The role, or (if taking it fails) the ring closed again before the error goes on."""
    try:
        return make()
    except BaseException:
        ring.close()
        raise


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


class MessageQueue:
    """The writer's end when constructed; a reader's end from create_from_handle() or attach().

    Each reader receives every message enqueued after it joined, exactly once, in order.
    Messages larger than a chunk travel as fragments through the following chunks. A reader
    skips (MessageTooLargeError) a message of more than its max_message_bytes, and steps over
    a damaged one (RingFormatError): the next dequeue goes on with the message after it.
    """

    def __init__(
        self,
        n_reader: int,
        max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
        max_chunks: int = DEFAULT_MAX_CHUNKS,
        *,
        name: str | None = None,
        directory: str = DEFAULT_DIRECTORY,
        file_mode: int = DEFAULT_FILE_MODE,
        owner: tuple[int, int] | None = None,
        wait_policy: WaitPolicy | None = None,
        on_dead_reader: DeadReaderAction = "raise",
        oob_threshold: int = OOB_THRESHOLD,
    ) -> None:
        ring = ShmRingBuffer(
            n_reader,
            max_chunk_bytes,
            max_chunks,
            name,
            directory=directory,
            create=True,
            file_mode=file_mode,
            owner=owner,
        )
        writer = _role_or_close(
            ring, lambda: RingWriter(ring, wait_policy, on_dead_reader=on_dead_reader)
        )
        self._setup(ring, writer, oob_threshold, unlink=True)

    def _setup(
        self,
        ring: ShmRingBuffer,
        role: RingWriter | RingReader,
        oob_threshold: int,
        unlink: bool,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> None:
        self._ring = ring
        self._writer = role if isinstance(role, RingWriter) else None
        self._reader = role if isinstance(role, RingReader) else None
        self._unlink = unlink
        self._encoder = MessageEncoder(oob_threshold)
        self._assembler = FragmentAssembler(ring.path, max_message_bytes)
        self._closed = False

    @classmethod
    def writer_of(
        cls,
        ring: ShmRingBuffer,
        *,
        wait_policy: WaitPolicy | None = None,
        on_dead_reader: DeadReaderAction = "raise",
        remove_on_close: bool | None = None,
        oob_threshold: int = OOB_THRESHOLD,
    ) -> MessageQueue:
        """The writer's end over an open ring; the queue takes the ring over and closes it.
        remove_on_close=None removes the file if this process created it."""
        writer = _role_or_close(
            ring, lambda: RingWriter(ring, wait_policy, on_dead_reader=on_dead_reader)
        )
        queue = cls.__new__(cls)
        unlink = ring.is_creator if remove_on_close is None else remove_on_close
        queue._setup(ring, writer, oob_threshold, unlink)
        return queue

    @classmethod
    def reader_of(
        cls,
        ring: ShmRingBuffer,
        rank: int | None = None,
        *,
        wait_policy: WaitPolicy | None = None,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> MessageQueue:
        """A reader's end over an open ring (slot `rank`, or the first free one); the queue
        takes the ring over and closes it. Messages of more than max_message_bytes are
        skipped unread (MessageTooLargeError), so a reader that expects small messages bounds
        what a scribbled ring can make it hold."""

        def take_slot() -> RingReader:
            check_max_message_bytes(max_message_bytes)
            return RingReader(ring, rank, wait_policy)

        reader = _role_or_close(ring, take_slot)
        queue = cls.__new__(cls)
        queue._setup(ring, reader, OOB_THRESHOLD, False, max_message_bytes)
        return queue

    @classmethod
    def create_from_handle(
        cls,
        handle: RingHandle,
        rank: int | None = None,
        *,
        wait_policy: WaitPolicy | None = None,
        attach_timeout: float = DEFAULT_ATTACH_TIMEOUT_SECONDS,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> MessageQueue:
        """A reader, from the writer's export_handle(). rank=None takes the first free slot."""
        return cls.reader_of(
            handle.attach(attach_timeout),
            rank,
            wait_policy=wait_policy,
            max_message_bytes=max_message_bytes,
        )

    @classmethod
    def attach(
        cls,
        path: str,
        rank: int | None = None,
        *,
        wait_policy: WaitPolicy | None = None,
        attach_timeout: float = DEFAULT_ATTACH_TIMEOUT_SECONDS,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
    ) -> MessageQueue:
        """A reader, from the ring file's path alone (e.g. in a pod mounting the region dir).

        Also how a replacement reader re-joins: attach with the dead reader's rank."""
        ring = ShmRingBuffer.attach(path, attach_timeout)
        return cls.reader_of(
            ring, rank, wait_policy=wait_policy, max_message_bytes=max_message_bytes
        )

    @classmethod
    def resume_writer(
        cls,
        path: str,
        *,
        wait_policy: WaitPolicy | None = None,
        on_dead_reader: DeadReaderAction = "raise",
        remove_on_close: bool = False,
        attach_timeout: float = DEFAULT_ATTACH_TIMEOUT_SECONDS,
        accept: Callable[[RingLayout], bool] | None = None,
    ) -> MessageQueue:
        """Become the writer of an existing ring whose writer died (e.g. a restarted agent).

        Readers stay attached and joined; the new writer continues where the old one stopped.
        A message the old writer left half-sent is dropped by the readers, never returned.
        `accept` refuses a geometry before the file is mapped (a writer that knows what it
        created passes `expected.__eq__`).
        """
        return cls.writer_of(
            ShmRingBuffer.attach(path, attach_timeout, accept),
            wait_policy=wait_policy,
            on_dead_reader=on_dead_reader,
            remove_on_close=remove_on_close,
        )

    # -- identity ----------------------------------------------------------------------------

    @property
    def path(self) -> str:
        return self._ring.path

    @property
    def is_writer(self) -> bool:
        return self._writer is not None

    @property
    def rank(self) -> int | None:
        """This reader's slot; None for the writer."""
        return None if self._reader is None else self._reader.rank

    @property
    def n_reader(self) -> int:
        return self._ring.n_reader

    def export_handle(self) -> RingHandle:
        return self._ring.handle()

    def _require_writer(self) -> RingWriter:
        if self._writer is None:
            raise IpcError(f"this end of {self.path} is reader {self.rank}; only the writer sends")
        return self._writer

    def _require_reader(self) -> RingReader:
        if self._reader is None:
            raise IpcError(f"this end of {self.path} is the writer; only readers receive")
        return self._reader

    # -- messages ----------------------------------------------------------------------------

    def enqueue(
        self, obj: Any, timeout: float | None = None, cancel: CancelEvent | None = None
    ) -> None:
        """Send obj to every joined reader. A timeout or cancel before the message's first
        chunk sends nothing; one in the middle of a large message leaves a part that every
        reader drops."""
        writer = self._require_writer()
        deadline = None if timeout is None else time.monotonic() + timeout
        chunk = writer.acquire(timeout, cancel)
        if self._encoder.encode_into(chunk, obj):
            writer.publish()
            return
        self._send_fragments(writer, chunk, obj, deadline, cancel)

    def _send_fragments(
        self,
        writer: RingWriter,
        chunk: memoryview,
        obj: Any,
        deadline: float | None,
        cancel: CancelEvent | None,
    ) -> None:
        """Send obj's body through consecutive chunks, starting with the one acquired."""
        pieces, total = self._encoder.encode_body(obj)
        cursor = PieceCursor(pieces)
        sent = 0
        while True:
            if sent == 0:
                FRAGMENT.pack_into(chunk, 0, 1, FIRST, total)
            else:
                FRAGMENT.pack_into(chunk, 0, 1, CONTINUATION, sent)
            take = min(len(chunk) - FRAGMENT.size, total - sent)
            cursor.copy_into(chunk[FRAGMENT.size : FRAGMENT.size + take])
            writer.publish()
            sent += take
            if sent == total:
                return
            try:
                chunk = writer.acquire(_remaining(deadline), cancel)
            except IpcError as exc:
                exc.add_note(
                    f"{sent} of {total} bytes of the message were sent; readers drop that part"
                )
                raise

    def dequeue(
        self,
        timeout: float | None = None,
        cancel: CancelEvent | None = None,
        indefinite: bool = False,
    ) -> Any:
        """The next message. indefinite=True waits without "still waiting" warnings."""
        reader = self._require_reader()
        deadline = None if timeout is None else time.monotonic() + timeout
        assembler = self._assembler
        while True:
            try:
                chunk = reader.acquire(_remaining(deadline), cancel, indefinite)
            except WriterDiedError as exc:
                dropped = assembler.drop("its writer died")
                if not dropped:
                    raise
                raise WriterDiedError(exc.path, exc.who, exc.grace_seconds, dropped) from None
            try:
                if chunk[0] == 0:
                    if assembler.pending_bytes:
                        assembler.drop("a new message began before it was complete")
                    return decode(chunk, 1, copy_buffers=True)
                body = assembler.add(chunk)
            finally:
                reader.release()
            if body is not None:
                return decode(body, 0, copy_buffers=False)

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Start-up handshake: the writer waits until every reader slot has joined; a reader
        waits until the writer has accepted it."""
        if self._writer is not None:
            self._writer.wait_until_ready(timeout)
        else:
            self._require_reader().wait_until_ready(timeout)

    def broadcast_object(self, obj: Any = None) -> Any:
        """The writer sends obj and returns it; a reader returns what it receives."""
        if self._writer is not None:
            self.enqueue(obj)
            return obj
        return self.dequeue()

    # -- reader management (writer side) --------------------------------------------------

    def evict_reader(self, rank: int) -> None:
        """Stop waiting for reader `rank` (after ReaderDiedError); it can re-join by attach."""
        self._require_writer().evict_reader(rank)

    def joined_readers(self) -> list[int]:
        return self._require_writer().joined_readers()

    # -- cleanup ---------------------------------------------------------------------------

    def close(self) -> None:
        """Give up this end; the creator also removes the ring file. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for role in (self._writer, self._reader):
            if role is not None:
                role.close()
        self._ring.close(unlink=self._unlink)

    def __enter__(self) -> MessageQueue:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "writer" if self._writer is not None else f"reader {self.rank}"
        return f"MessageQueue({self.path!r}, {role}, n_reader={self.n_reader})"
