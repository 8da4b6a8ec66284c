"""ShmRingBuffer: vLLM's ShmRingBuffer: a ring of chunks and flags in one shared file.

This class is the memory: it creates or attaches the file and hands out views of chunks,
flags and registry. The flag protocol lives in RingWriter (one per ring) and RingReader (one
per reader slot); MessageQueue puts pickled messages through them.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvshm.ipc.errors import RingConfigError, RingFormatError, RingTimeout
from kvshm.ipc.layout import RingLayout
from kvshm.ipc.registry import Registry
from kvshm.ipc.ringfile import DEFAULT_DIRECTORY, DEFAULT_FILE_MODE, RingFile, random_name
from kvshm.region.memory import mapping_address

DEFAULT_ATTACH_TIMEOUT_SECONDS = 10.0
_ATTACH_POLL_SECONDS = 0.005


@dataclass(frozen=True)
class RingHandle:
    """Everything another process needs to attach: small, picklable, printable."""

    n_reader: int
    max_chunk_bytes: int
    max_chunks: int
    name: str
    directory: str = DEFAULT_DIRECTORY

    @property
    def path(self) -> str:
        return os.path.join(self.directory, self.name)

    def attach(self, attach_timeout: float = DEFAULT_ATTACH_TIMEOUT_SECONDS) -> ShmRingBuffer:
        return ShmRingBuffer(
            self.n_reader,
            self.max_chunk_bytes,
            self.max_chunks,
            self.name,
            directory=self.directory,
            attach_timeout=attach_timeout,
        )


class ShmRingBuffer:
    """One writer, n_reader readers, max_chunks chunks of max_chunk_bytes, in one file.

    name=None creates a ring under a fresh random name; a name attaches to that ring (as
    vLLM's ShmRingBuffer does) unless create=True. directory is /dev/shm by default; give a
    region's directory for a ring that pods mounting that directory attach to by path. The
    creator removes the file when it closes the ring. Pickles as its handle: unpickling
    attaches.
    """

    def __init__(
        self,
        n_reader: int,
        max_chunk_bytes: int,
        max_chunks: int,
        name: str | None = None,
        *,
        directory: str = DEFAULT_DIRECTORY,
        create: bool | None = None,
        file_mode: int = DEFAULT_FILE_MODE,
        owner: tuple[int, int] | None = None,
        attach_timeout: float = DEFAULT_ATTACH_TIMEOUT_SECONDS,
    ) -> None:
        layout = RingLayout(n_reader, max_chunk_bytes, max_chunks)
        if create is None:
            create = name is None
        if name is None:
            if not create:
                raise RingConfigError("attaching needs the ring's name (or use attach(path))")
            name = random_name()
        if create:
            file = RingFile.create(directory, name, layout.total_bytes, file_mode, owner)
            # zero pages mean "nothing written, nothing read"; the trailer goes last, so an
            # attacher that sees it sees a complete, initialised ring
            file.mapping[layout.trailer_offset : layout.total_bytes] = layout.trailer()
        else:
            file, found = _open_ring(directory, name, attach_timeout)
            if found != layout:
                file.close()
                raise RingFormatError(
                    f"ring {file.path} has {found.n_reader} readers, {found.max_chunks} chunks "
                    f"of {found.max_chunk_bytes} bytes, not {n_reader}, {max_chunks} of "
                    f"{max_chunk_bytes}: use its handle, or attach(path) to take it as it is"
                )
        self._setup(file, layout)

    @classmethod
    def attach(
        cls,
        path: str,
        attach_timeout: float = DEFAULT_ATTACH_TIMEOUT_SECONDS,
        accept: Callable[[RingLayout], bool] | None = None,
    ) -> ShmRingBuffer:
        """Attach by path alone (the geometry is read from the file), waiting for it to exist.
        `accept` may refuse the geometry the file names before anything is mapped."""
        directory, name = os.path.split(os.path.abspath(path))
        file, layout = _open_ring(directory, name, attach_timeout, accept)
        ring = cls.__new__(cls)
        ring._setup(file, layout)
        return ring

    def _setup(self, file: RingFile, layout: RingLayout) -> None:
        self.layout = layout
        self.n_reader = layout.n_reader
        self.max_chunk_bytes = layout.max_chunk_bytes
        self.max_chunks = layout.max_chunks
        self.data_offset = layout.data_offset
        self.metadata_offset = layout.metadata_offset
        self.file = file
        buffer = memoryview(file.mapping)
        self._buffer = buffer
        self.chunks = [
            buffer[layout.chunk_offset(i) : layout.chunk_offset(i) + layout.max_chunk_bytes]
            for i in range(layout.max_chunks)
        ]
        self.flags = [
            buffer[layout.flags_offset(i) : layout.flags_offset(i) + layout.flags_per_chunk]
            for i in range(layout.max_chunks)
        ]
        self.read_flags = [view[1:] for view in self.flags]
        self.registry = Registry(buffer, layout)
        self.wake_address = mapping_address(file.mapping) + layout.wake_offset
        views = [*self.read_flags, *self.flags, *self.chunks, buffer]
        # a creator that forgets close() still removes its file when collected or at exit
        self._finalizer = weakref.finalize(
            self, _release, file, views, self.registry, file.is_creator
        )

    # -- what vLLM's ShmRingBuffer offers -----------------------------------------------------

    @property
    def name(self) -> str:
        return self.file.name

    @property
    def path(self) -> str:
        return self.file.path

    @property
    def is_creator(self) -> bool:
        return self.file.is_creator

    def handle(self) -> RingHandle:
        return RingHandle(
            self.n_reader, self.max_chunk_bytes, self.max_chunks, self.name, self.file.directory
        )

    def get_data(self, index: int) -> memoryview:
        return self.chunks[index]

    def get_metadata(self, index: int) -> memoryview:
        return self.flags[index]

    def __reduce__(self) -> tuple[Any, tuple[RingHandle]]:
        return (_attach_handle, (self.handle(),))

    # -- used by the roles --------------------------------------------------------------------

    def mark_read_everywhere(self, rank: int) -> None:
        """Set reader `rank`'s read flag on every chunk (join, leave and eviction)."""
        start = self.layout.metadata_offset + 1 + rank
        stop = self.layout.metadata_offset + self.max_chunks * self.layout.flags_per_chunk
        self._buffer[start : stop : self.layout.flags_per_chunk] = b"\x01" * self.max_chunks

    # -- cleanup ------------------------------------------------------------------------------

    def close(self, unlink: bool | None = None) -> None:
        """Unmap; remove the file if unlink (by default: if this process created it).
        Idempotent."""
        if not self._finalizer.alive:
            return
        detached = self._finalizer.detach()
        assert detached is not None
        file, views, registry, created = detached[2]
        _release(file, views, registry, created if unlink is None else unlink)

    def __enter__(self) -> ShmRingBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ShmRingBuffer({self.path!r}, n_reader={self.n_reader}, "
            f"max_chunks={self.max_chunks}, max_chunk_bytes={self.max_chunk_bytes})"
        )


def _release(file: RingFile, views: list[memoryview], registry: Registry, unlink: bool) -> None:
    if unlink:
        file.unlink()
    registry.release()
    for view in views:
        view.release()
    file.close()


def _attach_handle(handle: RingHandle) -> ShmRingBuffer:
    return handle.attach()


def _open_ring(
    directory: str,
    name: str,
    timeout: float,
    accept: Callable[[RingLayout], bool] | None = None,
) -> tuple[RingFile, RingLayout]:
    """Open and map the ring, waiting until it exists and its creator has finished it."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            opened = RingFile.open(directory, name, accept)
        except FileNotFoundError:
            opened = None
        if opened is not None:
            return opened
        if time.monotonic() >= deadline:
            raise RingTimeout(
                f"ring {os.path.join(directory, name)} did not appear, or its creator did not "
                f"finish it, within {timeout:g} s: check the path, and that the writer is up"
            )
        time.sleep(_ATTACH_POLL_SECONDS)
