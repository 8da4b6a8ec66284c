"""The copy kernel: a bounded grid of programs, each moving 16-byte words chunk by chunk.

Host addresses are registered memory, which on a system with unified addressing the GPU
reads and writes at the same address (cudaHostRegister's default flags map it), so the
kernel treats every address alike; it reads its descriptor table from pinned host memory
too, which needs no copy engine to upload it. Importing this module imports Triton: do it
lazily.
"""

from __future__ import annotations

import triton
import triton.language as tl


# the table addresses, count and chunk count vary per job: specializing on them (Triton does
# for values divisible by 16 or equal to 1) would compile a variant mid-serving
@triton.jit(do_not_specialize=["sources", "destinations", "sizes", "count", "chunks_per_copy"])
def copy_blocks_kernel(  # type: ignore[no-untyped-def]
    sources, destinations, sizes, count, chunks_per_copy, CHUNK_BYTES: tl.constexpr
):
    """Copy i moves sizes[i] bytes from sources[i] to destinations[i]; the three are int64
    arrays of count entries given by address (usually rows of one pinned table).

    The work is count x chunks_per_copy chunks; program p takes chunks p, p + G, p + 2G, ...
    for a grid of G programs. A bounded grid lets the other direction's kernel (and the
    serving engine's compute) run beside this one: a grid of one program per chunk fills
    every SM until it drains, so two directions would take turns. Addresses and sizes are
    multiples of 16 bytes (the backend checks it), which the hints below tell the compiler
    so that each thread moves 16 bytes per access.
    """
    source_table = sources.to(tl.pointer_type(tl.int64))
    destination_table = destinations.to(tl.pointer_type(tl.int64))
    size_table = sizes.to(tl.pointer_type(tl.int64))
    for work in range(tl.program_id(0), count * chunks_per_copy, tl.num_programs(0)):
        copy = work // chunks_per_copy
        start = (work % chunks_per_copy).to(tl.int64) * CHUNK_BYTES
        size = tl.load(size_table + copy)
        src = (tl.load(source_table + copy) + start).to(tl.pointer_type(tl.int64))
        dst = (tl.load(destination_table + copy) + start).to(tl.pointer_type(tl.int64))
        src = tl.multiple_of(src, 16)
        dst = tl.multiple_of(dst, 16)
        words = tl.multiple_of((size - start) // 8, 2)
        offsets = tl.arange(0, CHUNK_BYTES // 8)
        mask = offsets < words
        tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)
