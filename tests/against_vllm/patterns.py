"""The bytes each side writes into one (rank, block, tensor) slice: its first four bytes name
the writer and the slice, the rest is a ramp, so every slice of every writer differs."""

from __future__ import annotations

import torch

WRITERS = {"vllm": 1, "kvshm": 2}


def pattern(writer: str, rank: int, block: int, tensor: int, size: int) -> torch.Tensor:
    ramp = (torch.arange(size, dtype=torch.int64) * 7 + block * 3 + tensor) % 256
    ramp[:4] = torch.tensor([WRITERS[writer], rank, block % 256, tensor])
    return ramp.to(torch.uint8).view(torch.int8)
