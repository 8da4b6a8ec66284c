"""The cost, at engine start, of the weights identity of a local model directory: the sampled
content digest of its weight files (kvshm.vllm.warm.weights), cold and warm, against hashing the
files whole.

    .venv/bin/python \\
        bench/warm_restart/weights_digest.py --directory /var/tmp/kvshm-weights [--make-gib 8]

--make-gib writes safetensors shards shaped like Llama-3.1-70B's (bf16, random bytes: the
embedding, then whole decoder layers, about 4 GiB a shard) into --directory first, unless
shards are there already (--tiny: a model a thousandth that size, for a quick run; --remove:
what was made is removed at the end). --directory must be on a disk for a cold figure: a
tmpfs's pages are never dropped. Then, --rounds times: every weight file's pages dropped from
the page cache (posix_fadvise DONTNEED on these files only, so other processes' cache is left
alone) and kvshm.vllm.warm.identity.weights_fingerprint timed (cold), then timed again (warm).
Last, a whole-file SHA-256 of the same files from the page cache, for contrast. Each figure is
also given per GB and extrapolated to 140 GB (Llama-3.1-70B in bf16), linearly: the samples
are a fixed stride of each tensor, so their count grows with the bytes.

"Cold" is the guest's page cache: on a virtual disk the host may still cache the file, so a
cold figure here is the best a cold start can be, not the worst.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import platform
import statistics
import struct
import time
from pathlib import Path
from typing import Any

from kvshm.region import memory
from kvshm.vllm.warm.identity import weights_fingerprint
from kvshm.vllm.warm.weights import sample_plan

GB = 10**9
TARGET_BYTES = 140 * GB
# Llama-3.1-70B (config.json): hidden 8192, intermediate 28672, 8 KV heads of 128, vocab 128256
LLAMA_70B = (8192, 28672, 8 * 128, 128256)
TINY = (256, 896, 32, 1000)
SHARD_BYTES = 4 << 30
WRITE_BLOCK = 64 << 20


def _bytes(shape: tuple[int, ...]) -> int:
    count = 2  # bf16
    for n in shape:
        count *= n
    return count


def _tensors(total: int, dims: tuple[int, int, int, int]) -> list[tuple[str, tuple[int, ...]]]:
    """The embedding, then whole decoder layers until `total` bytes."""
    hidden, intermediate, kv, vocab = dims
    layer_shapes = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (intermediate, hidden),
        "mlp.up_proj.weight": (intermediate, hidden),
        "mlp.down_proj.weight": (hidden, intermediate),
    }
    tensors: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    size, layer = _bytes((vocab, hidden)), 0
    while size < total:
        for name, shape in layer_shapes.items():
            tensors.append((f"model.layers.{layer}.{name}", shape))
            size += _bytes(shape)
        layer += 1
    return tensors


def _shards(tensors: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        if shards[-1] and size + _bytes(shape) > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += _bytes(shape)
    return shards


def write_shard(path: Path, tensors: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """A safetensors file as the format lays it out: the header's length, the header (padded to
    8 bytes with spaces), the tensors back to back."""
    import numpy as np

    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        size = _bytes(shape)
        header[name] = {
            "dtype": "BF16",
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        left = offset
        while left:
            block = min(left, WRITE_BLOCK)
            f.write(rng.bytes(block))
            left -= block


def make_model(directory: Path, total: int, dims: tuple[int, int, int, int]) -> list[Path]:
    shards = _shards(_tensors(total, dims))
    made = [directory / "config.json"]
    made[0].write_text(json.dumps({"model_type": "llama"}))
    for i, tensors in enumerate(shards):
        made.append(directory / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        write_shard(made[-1], tensors, seed=i)
        print(f"wrote {made[-1].name}", flush=True)
    return made


def weight_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def drop_cache(files: list[Path]) -> None:
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(files: list[Path]) -> float:
    """Of the files' bytes, the fraction in the page cache (mincore over a mapping of each; the
    files are the bench's own, mapped read-write and never written)."""
    cached = total = 0
    for path in files:
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mapping:
            cached += memory.resident_bytes(memory.mapping_address(mapping), len(mapping))
            total += len(mapping)
    return min(1.0, cached / total) if total else 0.0


def sampled_bytes(files: list[Path]) -> tuple[int, int]:
    """Bytes the digest reads, and how many reads."""
    read = reads = 0
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            header, samples = sample_plan(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        read += len(header) + sum(length for _, length in samples)
        reads += 2 + len(samples)
    return read, reads


def whole_hash(files: list[Path]) -> None:
    for path in files:
        with open(path, "rb") as f:
            hashlib.file_digest(f, "sha256")


def timed(run: Any) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--directory", type=Path, required=True)
    parser.add_argument("--make-gib", type=float, default=0.0)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--remove", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    directory = args.directory
    directory.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    if args.make_gib and not weight_files(directory):
        total = int(args.make_gib * (1 << 30) / (1000 if args.tiny else 1))
        made = make_model(directory, total, TINY if args.tiny else LLAMA_70B)
    try:
        measure(directory, args.rounds, args.json)
    finally:
        if args.remove:
            for path in made:
                path.unlink()


def measure(directory: Path, rounds: int, json_path: Path | None) -> None:
    files = weight_files(directory)
    total = sum(p.stat().st_size for p in files)
    read, reads = sampled_bytes(files)
    cold, warm, cold_left = [], [], []
    fingerprint = None
    for _ in range(rounds):
        drop_cache(files)
        cold_left.append(cached_fraction(files))
        cold.append(timed(lambda: weights_fingerprint(str(directory), None, [])))
        warm.append(timed(lambda: weights_fingerprint(str(directory), None, [])))
        found = weights_fingerprint(str(directory), None, [])
        assert fingerprint in (None, found), "the fingerprint changed between rounds"
        fingerprint = found
    whole_hash(files)  # into the page cache, as far as it fits
    whole = timed(lambda: whole_hash(files))
    scale = TARGET_BYTES / total
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    result: dict[str, Any] = {
        "host": platform.node(),
        "load": os.getloadavg(),
        "files": len(files),
        "bytes": total,
        "sampled_bytes": read,
        "reads": reads,
        "cached_before_cold": max(cold_left),
        "cold_s": cold_s,
        "cold_s_all": cold,
        "warm_s": warm_s,
        "warm_s_all": warm,
        "whole_sha256_s": whole,
        "at_140_gb": {
            "sampled_bytes": read * scale,
            "cold_s": cold_s * scale,
            "warm_s": warm_s * scale,
            "whole_sha256_s": whole * scale,
        },
    }
    print(
        f"{len(files)} files, {total / GB:.2f} GB; the digest reads {read / 1e6:.1f} MB in "
        f"{reads} reads ({read / total:.3%})\n"
        f"sampled digest: cold {cold_s:.3f} s (pages cached before: "
        f"{max(cold_left):.1%}), warm {warm_s:.3f} s; "
        f"whole-file SHA-256 (warm): {whole:.2f} s, {total / whole / GB:.2f} GB/s\n"
        f"at 140 GB: reads {read * scale / 1e6:.0f} MB; cold {cold_s * scale:.2f} s, "
        f"warm {warm_s * scale:.3f} s; whole-file SHA-256 {whole * scale:.0f} s"
    )
    if json_path:
        json_path.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
