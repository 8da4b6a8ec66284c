"""kvshm.vllm.warm.weights and the weights identity of a local model directory: two weight files of
equal names, sizes and mtimes but other bytes (two fine-tunes of one architecture, built
reproducibly) are told apart; equal weights are one identity. Files written by the safetensors
library itself."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvshm.vllm.warm.identity import weights_fingerprint
from kvshm.vllm.warm.weights import (
    FILE_STRIDE,
    SAMPLE_BYTES,
    TENSOR_STRIDE,
    WHOLE_TENSOR_BYTES,
    content_digest,
    sample_plan,
)

# a Llama-shaped layer, small but for one projection past the sampling stride (bf16)
LAYOUT = {
    "model.embed_tokens.weight": (1000, 256),
    "model.layers.0.input_layernorm.weight": (256,),
    "model.layers.0.self_attn.q_proj.weight": (256, 256),
    "model.layers.0.self_attn.k_proj.weight": (64, 256),
    "model.layers.0.mlp.up_proj.weight": (5120, 4096),  # 40 MiB
    "model.layers.0.post_attention_layernorm.weight": (256,),
    "lm_head.weight": (1000, 256),
}
BUILT_AT = 315_532_800 * 10**9  # one mtime for every file, as a reproducible image build sets
WEIGHTS = "model.safetensors"


def base_weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        name: (torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for name, shape in LAYOUT.items()
    }


def fine_tuned(weights: dict[str, torch.Tensor], trained: list[str]) -> dict[str, torch.Tensor]:
    """The weights after a few training steps that updated only `trained` (a small dense
    change, as an optimizer's or a merged LoRA's)."""
    generator = torch.Generator().manual_seed(1)
    tuned = dict(weights)
    for name in trained:
        delta = torch.randn(weights[name].shape, generator=generator) * 1e-3
        tuned[name] = (weights[name].float() + delta).to(torch.bfloat16)
    return tuned


def model_dir(path: Path, weights: dict[str, torch.Tensor], mtime_ns: int = BUILT_AT) -> Path:
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    save_file(weights, str(path / WEIGHTS))
    for file in path.iterdir():
        os.utime(file, ns=(mtime_ns, mtime_ns))
    return path


def fingerprint(path: Path) -> str:
    found = weights_fingerprint(str(path), None, [])
    assert found is not None
    return found


@pytest.mark.parametrize(
    "trained",
    [
        list(LAYOUT),
        ["model.layers.0.mlp.up_proj.weight"],
        ["model.layers.0.self_attn.q_proj.weight"],
        ["model.layers.0.post_attention_layernorm.weight"],
    ],
    ids=["every tensor", "the largest projection", "a small projection", "one norm"],
)
def test_fine_tunes_of_equal_names_sizes_and_mtimes_are_two_identities(
    tmp_path: Path, trained: list[str]
) -> None:
    base = base_weights()
    one = model_dir(tmp_path / "base", base)
    two = model_dir(tmp_path / "tuned", fine_tuned(base, trained))
    a, b = os.stat(one / WEIGHTS), os.stat(two / WEIGHTS)
    assert (a.st_size, a.st_mtime_ns) == (b.st_size, b.st_mtime_ns)
    assert (one / WEIGHTS).read_bytes() != (two / WEIGHTS).read_bytes()
    assert fingerprint(one) != fingerprint(two)


def test_equal_weights_are_one_identity_whatever_their_mtimes(tmp_path: Path) -> None:
    base = base_weights()
    one = model_dir(tmp_path / "built", base)
    two = model_dir(tmp_path / "copied", base, mtime_ns=BUILT_AT + 86_400 * 10**9)
    assert fingerprint(one) == fingerprint(two)
    shutil.copyfile(one / WEIGHTS, tmp_path / "copy.safetensors")
    assert content_digest(str(tmp_path / "copy.safetensors")) == content_digest(str(one / WEIGHTS))


def test_the_samples_hold_the_header_and_every_tensors_ends_and_stride(tmp_path: Path) -> None:
    path = model_dir(tmp_path / "m", base_weights()) / WEIGHTS
    data = path.read_bytes()
    header_bytes = struct.unpack_from("<Q", data)[0]
    entries = json.loads(data[8 : 8 + header_bytes])
    fd = os.open(path, os.O_RDONLY)
    try:
        header, samples = sample_plan(fd, len(data))
    finally:
        os.close(fd)
    assert header == data[: 8 + header_bytes]
    sampled = bytearray(len(data))
    for offset, length in samples:
        sampled[offset : offset + length] = b"\1" * length
    for name, entry in entries.items():
        if name == "__metadata__":
            continue
        begin, end = (8 + header_bytes + o for o in entry["data_offsets"])
        assert sampled[begin] and sampled[end - 1], name
        if end - begin <= WHOLE_TENSOR_BYTES:
            assert all(sampled[begin:end]), name
        starts = [o for o, _ in samples if begin <= o < end]
        assert all(b - a <= TENSOR_STRIDE for a, b in itertools.pairwise(starts)), name
    read = sum(length for _, length in samples)
    assert read < len(data) / 100  # of a 42 MB file, under 1 %


def hostile_safetensors(path: Path, header: bytes, body: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + body)


@pytest.mark.parametrize(
    "header",
    [
        b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
        b'"a string"',
        b'{"t": {"data_offsets": [0, 99999999999]}}',
        b'{"t": {"data_offsets": [5, 4]}}',
        b'{"t": {"data_offsets": [0, true]}}',
        b"not json",
    ],
    ids=["deep", "not an object", "past the end", "backwards", "not integers", "garbage"],
)
def test_a_header_that_is_no_safetensors_one_is_sampled_across_the_file(
    tmp_path: Path, header: bytes
) -> None:
    body = os.urandom(3 * FILE_STRIDE)
    changed = bytearray(body)
    for at in range(0, len(changed), SAMPLE_BYTES):
        changed[at] ^= 1  # every page of the file differs
    hostile_safetensors(tmp_path / "one.safetensors", header, body)
    hostile_safetensors(tmp_path / "two.safetensors", header, bytes(changed))
    one = content_digest(str(tmp_path / "one.safetensors"))
    assert one.startswith("sha256:") and one != content_digest(str(tmp_path / "two.safetensors"))


def test_a_header_length_past_the_file_is_no_header(tmp_path: Path) -> None:
    path = tmp_path / "model.bin"
    path.write_bytes(struct.pack("<Q", 1 << 62) + os.urandom(5000))
    fd = os.open(path, os.O_RDONLY)
    try:
        header, samples = sample_plan(fd, 5008)
    finally:
        os.close(fd)
    assert header == b"" and samples == [(0, 5008)]
