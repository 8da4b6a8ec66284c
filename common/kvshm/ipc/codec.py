"""Messages in chunks: vLLM's MessageQueue in-chunk format, and kvshm's overflow fragments.

A message that fits one chunk:
    byte 0 = 0 (no overflow), bytes 1-2 = number of buffers (big-endian), then each buffer as a
    4-byte big-endian length and its bytes. Buffer 0 is the pickle (protocol 5); the others
    are its out-of-band buffers (PickleBuffers of at least oob_threshold bytes).
A message that does not fit travels through the following chunks of the same ring, in order
(the writer is the only writer, so nothing interleaves). Its body is the same format without
byte 0, cut into fragments; each chunk holds:
    byte 0 = 1 (overflow), byte 1 = 0 for the first fragment, 1 for the others, bytes 2-9 =
    the body's total length (first fragment) or this fragment's offset in the body (others,
    big-endian), then as much of the body as fits.
A reader returns a message only once all of it has arrived. Fragments it cannot place (it
joined mid-message) are skipped; a half-received message is dropped when another message
begins (the writer gave up on it: a timeout, or a writer that died and was replaced).

Whoever can write the ring file can write anything into a chunk, so a reader trusts no length
it finds there: a message body grows as its fragments arrive (a first fragment announcing a
terabyte costs nothing until a terabyte arrives), a message announcing more than the reader's
max_message_bytes is skipped unread, and lengths that do not fit are RingFormatError.
"""

from __future__ import annotations

import logging
import pickle
import struct
from typing import Any

from kvshm.ipc.errors import IpcError, MessageTooLargeError, RingConfigError, RingFormatError

log = logging.getLogger(__name__)

PROTOCOL = 5  # fixed, not HIGHEST_PROTOCOL: writer and readers may run other Pythons
OOB_THRESHOLD = 1 << 20
HEADER = struct.Struct(">BHI")  # overflow flag, number of buffers, length of buffer 0
BODY_HEADER = struct.Struct(">HI")  # HEADER without the overflow flag
LENGTH = struct.Struct(">I")
FRAGMENT = struct.Struct(">BBQ")  # overflow flag (1), first (0) or not (1), total or offset
FIRST, CONTINUATION = 0, 1
_MAX_BUFFERS = 0xFFFF
MAX_MESSAGE_BYTES = 1 << 40  # a first fragment announcing more is damage, not a message
_NO_CHUNK = memoryview(bytearray())


class _DoesNotFit(Exception):
    """Raised from inside the pickler when the next write would pass the chunk's end."""


class _ChunkSink:
    """A file-like the pickler writes straight into a chunk; large payloads are not copied
    twice (the C pickler passes them to write() directly)."""

    __slots__ = ("end", "pos", "view")

    def __init__(self) -> None:
        self.view = _NO_CHUNK
        self.pos = 0
        self.end = 0

    def write(self, data: Any) -> int:
        if type(data) is not bytes:
            data = memoryview(data).cast("B")
        size = len(data)
        start = self.pos
        if start + size > self.end:
            raise _DoesNotFit
        self.view[start : start + size] = data
        self.pos = start + size
        return size


class MessageEncoder:
    """Pickles messages into chunks, reusing one pickler."""

    def __init__(self, oob_threshold: int = OOB_THRESHOLD) -> None:
        self._threshold = oob_threshold
        self._oob: list[pickle.PickleBuffer] = []
        self._sink = _ChunkSink()
        self._pickler = pickle.Pickler(self._sink, PROTOCOL, buffer_callback=self._keep_large)

    def _keep_large(self, buffer: pickle.PickleBuffer) -> bool:
        """Buffer callback: True keeps a buffer in band, False sends it out of band."""
        if buffer.raw().nbytes < self._threshold:
            return True
        self._oob.append(buffer)
        return False

    def encode_into(self, chunk: memoryview, obj: Any) -> bool:
        """Write obj into chunk in the §7 format; False (chunk unusable) if it does not fit."""
        sink, oob = self._sink, self._oob
        oob.clear()
        sink.view, sink.pos, sink.end = chunk, HEADER.size, len(chunk)
        self._pickler.clear_memo()
        try:
            self._pickler.dump(obj)
        except _DoesNotFit:
            return False
        finally:
            sink.view = _NO_CHUNK
        if len(oob) >= _MAX_BUFFERS:
            return False
        pickle_bytes = sink.pos - HEADER.size
        position = sink.pos
        for buffer in oob:
            raw = buffer.raw()
            start = position + LENGTH.size
            if start + raw.nbytes > len(chunk):
                return False
            LENGTH.pack_into(chunk, position, raw.nbytes)
            chunk[start : start + raw.nbytes] = raw
            position = start + raw.nbytes
        HEADER.pack_into(chunk, 0, 0, 1 + len(oob), pickle_bytes)
        return True

    def encode_body(self, obj: Any) -> tuple[list[bytes | memoryview], int]:
        """obj's message body (the §7 format without byte 0) as pieces, and its total length."""
        self._oob.clear()
        data = pickle.dumps(obj, PROTOCOL, buffer_callback=self._keep_large)
        raws = [buffer.raw() for buffer in self._oob]
        if len(raws) >= _MAX_BUFFERS:
            raise IpcError(
                f"message has {len(raws)} out-of-band buffers; at most {_MAX_BUFFERS - 1} fit "
                f"the format: group them, or raise the out-of-band threshold"
            )
        pieces: list[bytes | memoryview] = [BODY_HEADER.pack(1 + len(raws), len(data)), data]
        for raw in raws:
            pieces += [LENGTH.pack(raw.nbytes), raw]
        return pieces, sum(len(piece) for piece in pieces)


class PieceCursor:
    """Copies a sequence of byte pieces into consecutive chunks without joining them first."""

    def __init__(self, pieces: list[bytes | memoryview]) -> None:
        self._pieces = [memoryview(piece).cast("B") for piece in pieces]
        self._index = 0
        self._offset = 0

    def copy_into(self, target: memoryview) -> None:
        """Fill all of target with the next len(target) bytes."""
        filled = 0
        while filled < len(target):
            piece = self._pieces[self._index]
            take = min(len(piece) - self._offset, len(target) - filled)
            target[filled : filled + take] = piece[self._offset : self._offset + take]
            filled += take
            self._offset += take
            if self._offset == len(piece):
                self._index += 1
                self._offset = 0


def decode(view: memoryview, offset: int, copy_buffers: bool) -> Any:
    """Unpickle the message body at view[offset:]. copy_buffers copies the out-of-band
    buffers out (needed when view is a chunk the writer will reuse)."""
    if len(view) - offset < BODY_HEADER.size:
        raise RingFormatError(
            f"damaged message: a body of {len(view) - offset} bytes, shorter than its "
            f"{BODY_HEADER.size}-byte header; the ring was written by something other than kvshm"
        )
    count, pickle_bytes = BODY_HEADER.unpack_from(view, offset)
    start = offset + BODY_HEADER.size
    end = start + pickle_bytes
    if count == 0 or end > len(view):
        raise RingFormatError(
            f"damaged message: {count} buffers, pickle of {pickle_bytes} bytes in "
            f"{len(view) - start} bytes; the ring was written by something other than kvshm"
        )
    if count == 1:
        return pickle.loads(view[start:end])
    buffers: list[bytearray | memoryview] = []
    position = end
    for _ in range(count - 1):
        if position + LENGTH.size > len(view):
            raise RingFormatError(
                f"damaged message: it claims {count} buffers but ends after fewer; the ring "
                f"was written by something other than kvshm"
            )
        (size,) = LENGTH.unpack_from(view, position)
        position += LENGTH.size
        if position + size > len(view):
            raise RingFormatError(f"damaged message: a buffer of {size} bytes runs past its end")
        part = view[position : position + size]
        buffers.append(bytearray(part) if copy_buffers else part)
        position += size
    return pickle.loads(view[start:end], buffers=buffers)


def check_max_message_bytes(limit: int) -> int:
    if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit <= MAX_MESSAGE_BYTES:
        raise RingConfigError(
            f"max_message_bytes must be a whole number of bytes in 1..{MAX_MESSAGE_BYTES}: "
            f"{limit!r}"
        )
    return limit


class FragmentAssembler:
    """One reader's message in the making, put together from overflow fragments.

    Messages announcing more than max_message_bytes are skipped (MessageTooLargeError names
    ring_path); the body grows with the fragments that arrive, never to what is announced.
    """

    def __init__(self, ring_path: str, max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self._ring_path = ring_path
        self._limit = check_max_message_bytes(max_message_bytes)
        self._body: bytearray | None = None
        self._total = 0

    @property
    def pending_bytes(self) -> int:
        return len(self._body) if self._body is not None else 0

    def drop(self, why: str) -> int:
        """Forget a half-received message; returns how many of its bytes had arrived."""
        dropped = self.pending_bytes
        if self._body is not None:
            log.warning(
                "dropped an unfinished message (%d of %d bytes): %s", dropped, self._total, why
            )
        self._body = None
        self._total = 0
        return dropped

    def add(self, chunk: memoryview) -> memoryview | None:
        """Take one overflow chunk; returns the whole body once its last fragment is in."""
        _, kind, value = FRAGMENT.unpack_from(chunk)
        if kind == FIRST:
            if self._body is not None:
                self.drop("a new message began before it was complete")
            if not BODY_HEADER.size <= value <= MAX_MESSAGE_BYTES:
                raise RingFormatError(
                    f"damaged message: its first fragment announces {value} bytes; the ring "
                    f"was written by something other than kvshm"
                )
            if value > self._limit:
                # its other fragments find no message begun, and are skipped like this one
                raise MessageTooLargeError(self._ring_path, value, self._limit)
            self._body = bytearray()
            self._total = value
        elif self._body is None or value != len(self._body):
            return None  # a fragment of a message this reader did not see begin: skip it
        body = self._body
        take = min(self._total - len(body), len(chunk) - FRAGMENT.size)
        body += chunk[FRAGMENT.size : FRAGMENT.size + take]
        if len(body) < self._total:
            return None
        self._body = None
        self._total = 0
        return memoryview(body)
