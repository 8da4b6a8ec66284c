"""Errors a caller of kvshm.transfer can cause; each says what was wrong and what to do."""

from __future__ import annotations


class TransferError(Exception):
    """Base class of every error kvshm.transfer raises on purpose."""


class InvalidTensorsError(TransferError, ValueError):
    """The GPU and CPU tensor lists given to a handler cannot be paired."""


class InvalidTransferSpecError(TransferError, ValueError):
    """A job's (source, destination) specs do not describe a valid transfer."""


class BackendUnavailableError(TransferError, RuntimeError):
    """The copy backend asked for cannot run in this process."""


class CudaCallError(TransferError, RuntimeError):
    """A CUDA driver call returned an error code."""

    def __init__(self, call: str, code: int) -> None:
        super().__init__(f"{call} failed with CUDA error {code}")
        self.call = call
        self.code = code


class HandlerClosedError(TransferError, RuntimeError):
    """A job was submitted to a handler after shutdown()."""
