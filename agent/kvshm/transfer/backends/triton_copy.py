"""The copy kernel: each program moves one chunk of one copy with 16-byte loads and stores.

Host addresses are registered memory, which on a system with unified addressing the GPU
reads and writes at the same address (cudaHostRegister's default flags map it), so the
kernel treats every address alike. Importing this module imports Triton: do it lazily.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def copy_blocks_kernel(table_ptr, count, CHUNK_BYTES: tl.constexpr):  # type: ignore[no-untyped-def]
    """table is (3, count) int64: sources, destinations, sizes. Grid: (count, chunks).

    Addresses and sizes are multiples of 16 bytes (the backend checks it), which the hints
    below tell the compiler so that each thread moves 16 bytes per access.
    """
    copy = tl.program_id(0)
    start = tl.program_id(1).to(tl.int64) * CHUNK_BYTES
    size = tl.load(table_ptr + 2 * count + copy)
    if start < size:
        src = (tl.load(table_ptr + copy) + start).to(tl.pointer_type(tl.int64))
        dst = (tl.load(table_ptr + count + copy) + start).to(tl.pointer_type(tl.int64))
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        words = tl.multiple_of((size - start) // 8, 2)
        offsets = tl.arange(0, CHUNK_BYTES // 8)
        mask = offsets < words
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)
