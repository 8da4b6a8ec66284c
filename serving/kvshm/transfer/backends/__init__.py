"""Copy backends: one interface, a CPU memmove backend, and GPU backends imported on use."""

from kvshm.transfer.backends.base import CopyBackend
from kvshm.transfer.backends.cpu import CpuMemmoveBackend

__all__ = ["CopyBackend", "CpuMemmoveBackend"]
