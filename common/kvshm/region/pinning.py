"""Registering a region with CUDA (cudaHostRegister) so DMA runs at link speed.

Registration is per process: the serving pod does it, never the agent. One call over about
512 GiB fails, so the region is registered in pieces of at most 64 GiB that end on row
boundaries (no block straddles two registrations). Failure is a warning: the region still
works, only slower.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_REGISTRATION_BYTES = 64 * 1024**3


def _error_code(result: Any) -> int:
    # torch returns a cudaError enum (a pybind object); int() gives the runtime's code
    return int(result.value) if hasattr(result, "value") else int(result)


def cuda_runtime() -> tuple[Any | None, str]:
    """torch's CUDA runtime bindings, or None and the reason they cannot be used."""
    try:
        import torch
    except ImportError:
        return None, "torch is not installed (pip install 'kvshm[transfer]')"
    if not torch.cuda.is_available():
        return None, "no CUDA device is visible to this process"
    return torch.cuda.cudart(), ""


class CudaRegistration:
    """The pieces of one mapping registered with CUDA; unregister() undoes them all."""

    def __init__(self, cudart: Any, address: int, chunks: list[tuple[int, int]]) -> None:
        self._cudart = cudart
        self._address = address
        self._chunks = chunks
        self._registered: list[tuple[int, int]] = []

    def register(self) -> None:
        for offset, length in self._chunks:
            code = _error_code(self._cudart.cudaHostRegister(self._address + offset, length, 0))
            if code != 0:
                self.unregister()
                raise OSError(
                    f"cudaHostRegister of {length} bytes at offset {offset} failed with CUDA "
                    f"error {code}"
                )
            self._registered.append((offset, length))

    def unregister(self, warn: Callable[[str], None] = log.warning) -> None:
        while self._registered:
            offset, _length = self._registered.pop()
            code = _error_code(self._cudart.cudaHostUnregister(self._address + offset))
            if code != 0:
                warn(f"cudaHostUnregister at offset {offset} failed with CUDA error {code}")

    @property
    def registered_bytes(self) -> int:
        return sum(length for _, length in self._registered)
