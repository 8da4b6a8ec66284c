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


@triton.jit
def _copy_chunk(source, destination, left, CHUNK_BYTES: tl.constexpr):  # type: ignore[no-untyped-def]
    """Copy min(left, CHUNK_BYTES) bytes between two addresses given as integers; both and
    `left` are multiples of 16 bytes, which the hints tell the compiler so that each thread
    moves 16 bytes per access."""
    src = tl.multiple_of(source.to(tl.pointer_type(tl.int64)), 16)
    dst = tl.multiple_of(destination.to(tl.pointer_type(tl.int64)), 16)
    words = tl.multiple_of(left // 8, 2)
    offsets = tl.arange(0, CHUNK_BYTES // 8)
    mask = offsets < words
    tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)


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
    multiples of 16 bytes (the backend checks it).
    """
    source_table = sources.to(tl.pointer_type(tl.int64))
    destination_table = destinations.to(tl.pointer_type(tl.int64))
    size_table = sizes.to(tl.pointer_type(tl.int64))
    for work in range(tl.program_id(0), count * chunks_per_copy, tl.num_programs(0)):
        copy = work // chunks_per_copy
        start = (work % chunks_per_copy).to(tl.int64) * CHUNK_BYTES
        size = tl.load(size_table + copy)
        source = tl.load(source_table + copy) + start
        destination = tl.load(destination_table + copy) + start
        _copy_chunk(source, destination, size - start, CHUNK_BYTES)


PAGE_KERNEL_BLOCKS = 16
"""Blocks one launch of copy_pages_kernel takes: their GPU ids are its arguments."""


_PAGE_ARGUMENTS = ["refs_table", "refs", "staged", "block_bytes", "blocks", "chunks_per_page"]


# a uniform job's pages, addressed from its block ids: the ids travel in the launch's own
# arguments, so the kernel reads no table from host memory (whose reads queue behind the
# other direction's copies on the link) and nothing is uploaded per job
@triton.jit(do_not_specialize=_PAGE_ARGUMENTS + [f"block{k}" for k in range(PAGE_KERNEL_BLOCKS)])
def copy_pages_kernel(  # type: ignore[no-untyped-def]
    refs_table,
    refs,
    staged,
    block_bytes,
    blocks,
    chunks_per_page,
    block0,
    block1,
    block2,
    block3,
    block4,
    block5,
    block6,
    block7,
    block8,
    block9,
    block10,
    block11,
    block12,
    block13,
    block14,
    block15,
    CHUNK_BYTES: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Between `blocks` (at most PAGE_KERNEL_BLOCKS) GPU blocks and a staging buffer: block k
    is GPU row block<k> of every ref and the cell at staged + k * block_bytes. refs_table is
    a (4, refs) int64 table in device memory, by address: per ref (in cell order) the GPU
    tensor's base, its block stride, the page's offset in the cell and the page's size.
    GATHER copies the GPU pages into the buffer, else the buffer's pages to the GPU.

    The work is blocks x refs x chunks_per_page chunks, taken by the programs in turn as in
    copy_blocks_kernel; addresses and sizes are multiples of 16 bytes."""
    table = refs_table.to(tl.pointer_type(tl.int64))
    per_block = refs * chunks_per_page
    for work in range(tl.program_id(0), blocks * per_block, tl.num_programs(0)):
        k = work // per_block
        rest = work - k * per_block
        ref = rest // chunks_per_page
        start = (rest - ref * chunks_per_page).to(tl.int64) * CHUNK_BYTES
        block = block15
        block = tl.where(k == 14, block14, block)
        block = tl.where(k == 13, block13, block)
        block = tl.where(k == 12, block12, block)
        block = tl.where(k == 11, block11, block)
        block = tl.where(k == 10, block10, block)
        block = tl.where(k == 9, block9, block)
        block = tl.where(k == 8, block8, block)
        block = tl.where(k == 7, block7, block)
        block = tl.where(k == 6, block6, block)
        block = tl.where(k == 5, block5, block)
        block = tl.where(k == 4, block4, block)
        block = tl.where(k == 3, block3, block)
        block = tl.where(k == 2, block2, block)
        block = tl.where(k == 1, block1, block)
        block = tl.where(k == 0, block0, block)
        gpu = tl.load(table + ref) + block.to(tl.int64) * tl.load(table + refs + ref) + start
        cell = staged + k.to(tl.int64) * block_bytes + tl.load(table + 2 * refs + ref) + start
        size = tl.load(table + 3 * refs + ref)
        if GATHER:
            _copy_chunk(gpu, cell, size - start, CHUNK_BYTES)
        else:
            _copy_chunk(cell, gpu, size - start, CHUNK_BYTES)
