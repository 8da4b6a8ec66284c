"""A weight file's content, digested from samples: what tells two weight files of equal names
and sizes apart when hashing them whole is too slow at engine start (docs/warm-restart.md#
the-weights-digest).

A safetensors file is an 8-byte header length, a JSON header naming every tensor's dtype, shape
and byte range, then the tensors. The digest covers the file's size, the whole header, and
samples of every tensor: tensors up to WHOLE_TENSOR_BYTES whole (norms, biases), larger ones at
fixed offsets no more than TENSOR_STRIDE apart, their first and last bytes included. A training
step changes a tensor it updates nearly everywhere, so two fine-tunes of one architecture differ
in the samples of every tensor either one trained. A file that is no safetensors (or whose
header does not parse) is sampled across its whole length at FILE_STRIDE.

The model directory is the tenant's: a header is bounded (MAX_HEADER_BYTES, safetensors' own
limit), parsed under a catch of whatever a hostile JSON can raise, and used only for byte
ranges inside the file; the digest then falls back to the file-wide samples.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from typing import Final

SAMPLE_BYTES: Final = 4096
TENSOR_STRIDE: Final = 16 << 20
WHOLE_TENSOR_BYTES: Final = 64 << 10
FILE_STRIDE: Final = 1 << 20
MAX_HEADER_BYTES: Final = 100_000_000
SCHEME: Final = b"kvshm weights digest 1\0"  # a change of the sampling is a new scheme
_U64 = struct.Struct("<Q")


def _spans(start: int, length: int, stride: int) -> Iterator[tuple[int, int]]:
    """(offset, length) samples of the bytes [start, start + length): all of them when short,
    else SAMPLE_BYTES at evenly spread offsets no more than `stride` apart, both ends included."""
    if length <= max(WHOLE_TENSOR_BYTES, SAMPLE_BYTES):
        if length > 0:
            yield start, length
        return
    room = length - SAMPLE_BYTES
    gaps = -(-room // stride)
    for i in range(gaps + 1):
        yield start + room * i // gaps, SAMPLE_BYTES


def _tensor_ranges(header: bytes, data_bytes: int) -> list[tuple[int, int]] | None:
    """Each tensor's (begin, end) in the data after the header, in file order; None when the
    header is no safetensors header (or names a range outside the file)."""
    try:
        entries = json.loads(header)
    except (ValueError, RecursionError):  # a tenant's JSON: malformed, or nested too deep
        return None
    if not isinstance(entries, dict):
        return None
    ranges = []
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (
            isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            return None
        ranges.append((offsets[0], offsets[1]))
    ranges.sort()
    return ranges


def sample_plan(fd: int, size: int) -> tuple[bytes, list[tuple[int, int]]]:
    """What the digest of the file open as `fd`, of `size` bytes, reads: the safetensors
    header's bytes (its length included; none for another file), and (offset, length) samples."""
    head = os.pread(fd, _U64.size, 0)
    if len(head) == _U64.size:
        header_bytes = _U64.unpack(head)[0]
        data_start = _U64.size + header_bytes
        if header_bytes <= MAX_HEADER_BYTES and data_start <= size:
            header = os.pread(fd, header_bytes, _U64.size)
            ranges = _tensor_ranges(header, size - data_start)
            if ranges is not None:
                samples = [
                    span
                    for begin, end in ranges
                    for span in _spans(data_start + begin, end - begin, TENSOR_STRIDE)
                ]
                return head + header, samples
    return b"", list(_spans(0, size, FILE_STRIDE))


def content_digest(path: str) -> str:
    """`sha256:<hex>` of the file's size, its safetensors header and its samples (above)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        header, samples = sample_plan(fd, size)
        for offset, length in samples:  # queued at once: a cold disk serves them in parallel
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        digest = hashlib.sha256(SCHEME)
        digest.update(_U64.pack(size))
        digest.update(_U64.pack(len(header)))
        digest.update(header)
        for offset, length in samples:
            digest.update(os.pread(fd, length, offset))
    finally:
        os.close(fd)
    return "sha256:" + digest.hexdigest()
