"""Registering the worker's part of the region with CUDA off the engine's start-up path.

cudaHostRegister takes about a second per 16 GiB; a worker registers only its own cells where
that pays (SharedOffloadRegion.pin(cells_only=True)), as vLLM registers its slots. The worker
starts it in a thread when it is created and the first transfer waits for it (no copy touches
the region unregistered), so the engine's other start-up work (model load, CUDA graphs) hides
it.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from kvshm.region import SharedOffloadRegion

log = logging.getLogger(__name__)


class BackgroundPin:
    def __init__(self, region: SharedOffloadRegion, device: torch.device) -> None:
        self._region = region
        self._device = device
        self.pinned = False
        self.pin_seconds = 0.0
        self.wait_seconds: float | None = None
        """How long the first transfer waited for the registration (None until it did)."""
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kvshm-pin", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            # registration belongs to the current device's context: make it the worker's GPU
            torch.cuda.set_device(self._device)
            self.pinned = self._region.pin(cells_only=True)
        except BaseException as exc:  # re-raised in the engine's thread by wait()
            self._error = exc
        self.pin_seconds = time.perf_counter() - started
        log.info(
            "kvshm: region %s %s in %.2f s (%d of its %d bytes)",
            self._region.mmap_path,
            "registered with CUDA" if self.pinned else "not registered",
            self.pin_seconds,
            self._region.pinned_bytes,
            self._region.layout.size_bytes,
        )

    def wait(self) -> None:
        started = time.perf_counter()
        self._thread.join()
        if self.wait_seconds is None:
            self.wait_seconds = time.perf_counter() - started
        if self._error is not None:
            raise self._error

    def wait_quietly(self) -> None:
        """Let the registration finish before the region is released; a failure is logged."""
        self._thread.join()
        if self._error is not None:
            log.warning("kvshm: registering %s failed: %s", self._region.mmap_path, self._error)

    def done(self) -> bool:
        return not self._thread.is_alive()
