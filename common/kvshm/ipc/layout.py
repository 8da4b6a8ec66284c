"""Where everything lies in a ring file.

    [ data: max_chunks x max_chunk_bytes ][ metadata: max_chunks x (1 + n_reader) ]  (vLLM's)
    [ registry: requests | kinds | acks | active | wake word | sleepers | reader slots |
      writer slot ][ trailer ]

Each chunk's metadata is its written flag followed by one read flag per reader. The registry
(kvshm's own bookkeeping: who holds which reader slot, join/leave requests and their
acknowledgements, the futex word and sleeping marks that wake idle readers, the writer's
cursor) starts on a 64-byte line after the metadata. The
trailer, the last 64 bytes, names the geometry so that a process can attach by path alone.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kvshm.ipc.errors import RingConfigError, RingFormatError

LINE = 64
MAX_READERS = 256
# Bounds on what a trailer may claim, so that attaching to a file someone else wrote costs
# bounded memory and time (a view per chunk is made on attach): far beyond any real ring.
MAX_CHUNKS = 1 << 16
MAX_CHUNK_BYTES = 1 << 30
MAGIC = b"KVSHMRB1"
VERSION = 2
_TRAILER = struct.Struct(">8sHHIQQ")  # magic, version, n_reader, max_chunks, chunk bytes, total
SLOT_BYTES = LINE  # one line per slot, so slots of different readers never share a line


def _line_up(offset: int) -> int:
    return -(-offset // LINE) * LINE


@dataclass(frozen=True)
class RingLayout:
    n_reader: int
    max_chunk_bytes: int
    max_chunks: int

    def __post_init__(self) -> None:
        for name in ("n_reader", "max_chunk_bytes", "max_chunks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise RingConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_reader > MAX_READERS:
            raise RingConfigError(
                f"n_reader is {self.n_reader}; a ring has at most {MAX_READERS} readers"
            )
        if self.max_chunks > MAX_CHUNKS or self.max_chunk_bytes > MAX_CHUNK_BYTES:
            raise RingConfigError(
                f"{self.max_chunks} chunks of {self.max_chunk_bytes} bytes: a ring has at most "
                f"{MAX_CHUNKS} chunks of at most {MAX_CHUNK_BYTES} bytes"
            )
        if self.max_chunk_bytes < LINE:
            raise RingConfigError(
                f"max_chunk_bytes is {self.max_chunk_bytes}; use at least {LINE} bytes "
                f"(a chunk holds a message header of up to 10 bytes besides the message)"
            )

    # -- vLLM's ShmRingBuffer area ---------------------------------------------------------------

    @property
    def data_offset(self) -> int:
        return 0

    @property
    def flags_per_chunk(self) -> int:
        return 1 + self.n_reader

    @property
    def metadata_offset(self) -> int:
        return self.max_chunks * self.max_chunk_bytes

    def chunk_offset(self, index: int) -> int:
        return self.data_offset + index * self.max_chunk_bytes

    def flags_offset(self, index: int) -> int:
        return self.metadata_offset + index * self.flags_per_chunk

    # -- kvshm's registry after it -----------------------------------------------------------

    @property
    def requests_offset(self) -> int:
        """One byte per reader: the generation of its latest join/leave request."""
        return _line_up(self.metadata_offset + self.max_chunks * self.flags_per_chunk)

    @property
    def kinds_offset(self) -> int:
        """One byte per reader: what its latest request asks (join or leave)."""
        return self.requests_offset + _line_up(self.n_reader)

    @property
    def acks_offset(self) -> int:
        """One byte per reader: the request generation the writer has carried out."""
        return self.kinds_offset + _line_up(self.n_reader)

    @property
    def active_offset(self) -> int:
        """One byte per reader: 1 while the writer waits for that reader, else 0."""
        return self.acks_offset + _line_up(self.n_reader)

    @property
    def wake_offset(self) -> int:
        """A 32-bit futex word the writer bumps after every publication, on its own line."""
        return self.active_offset + _line_up(self.n_reader)

    @property
    def sleepers_offset(self) -> int:
        """One byte per reader: 1 while it sleeps on the wake word."""
        return self.wake_offset + LINE

    def reader_slot_offset(self, rank: int) -> int:
        return self.sleepers_offset + _line_up(self.n_reader) + rank * SLOT_BYTES

    @property
    def writer_slot_offset(self) -> int:
        return self.reader_slot_offset(self.n_reader)

    @property
    def trailer_offset(self) -> int:
        return self.writer_slot_offset + SLOT_BYTES

    @property
    def total_bytes(self) -> int:
        return self.trailer_offset + LINE

    # -- the trailer -------------------------------------------------------------------------

    def trailer(self) -> bytes:
        return _TRAILER.pack(
            MAGIC,
            VERSION,
            self.n_reader,
            self.max_chunks,
            self.max_chunk_bytes,
            self.total_bytes,
        ).ljust(LINE, b"\0")

    @classmethod
    def from_trailer(cls, trailer: bytes, file_bytes: int, path: str) -> RingLayout | None:
        """The layout a ring file's trailer names; None while its creator is still writing it."""
        magic, version, n_reader, max_chunks, chunk_bytes, total = _TRAILER.unpack_from(trailer)
        if magic == b"\0" * len(MAGIC):
            return None
        if magic != MAGIC:
            raise RingFormatError(
                f"{path} is not a kvshm ring (its last {LINE} bytes do not start with "
                f"{MAGIC!r}); check the path"
            )
        if version != VERSION:
            raise RingFormatError(
                f"{path} is a kvshm ring of format version {version}; this kvshm reads "
                f"version {VERSION}. Use the same kvshm version on both sides."
            )
        try:
            layout = cls(n_reader, chunk_bytes, max_chunks)
        except RingConfigError as exc:
            raise RingFormatError(f"{path} has a damaged trailer: {exc}") from exc
        if layout.total_bytes != total or total != file_bytes:
            raise RingFormatError(
                f"{path} is {file_bytes} bytes but its trailer describes a ring of "
                f"{layout.total_bytes} bytes (trailer says {total}); the file is damaged"
            )
        return layout
