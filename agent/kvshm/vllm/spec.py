"""KvshmOffloadingSpec: vLLM 0.33's CPU offloading, on the kvshm agent's region.

The geometry (num_chunks, kv_bytes_per_chunk padded to 4096, cpu_page_size_per_worker,
replicated layout) and the scheduler side (CPUOffloadingManager) are vLLM's own: the spec
inherits them from CPUOffloadingSpec. Only the worker differs: it attaches the agent's region
instead of creating one, and moves blocks with kvshm's transfer handlers.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from kvshm.vllm.attach import attach_region
from kvshm.vllm.calibration import ChoiceCache
from kvshm.vllm.geometry import RegionGeometry
from kvshm.vllm.settings import PluginConfigError, PluginSettings
from kvshm.vllm.worker import KvshmOffloadingWorker
from vllm.v1.kv_offload.base import CanonicalKVCaches, OffloadingWorker
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

log = logging.getLogger(__name__)

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def calibration_cache(settings: PluginSettings) -> ChoiceCache | None:
    if not settings.calibrate:
        return None
    return ChoiceCache(Path(settings.cache_dir)) if settings.cache_dir else ChoiceCache()


class KvshmOffloadingSpec(CPUOffloadingSpec):
    def __init__(self, config: OffloadingConfig) -> None:
        if config.canonical_layout:
            raise PluginConfigError(
                "KvshmOffloadingSpec stores each worker's pages as they are (vLLM's direct "
                "layout); canonical_layout is not supported: remove it from "
                "kv_connector_extra_config"
            )
        super().__init__(config)
        parallel = config.parallel
        self.settings = PluginSettings.from_extra_config(
            self.extra_config,
            config.engine_id,
            parallel.data_parallel_index,
            parallel.data_parallel_size,
        )

    def _uses_shared_region(self) -> bool:
        # the agent's region is always a shared mapping, so MLA's single-copy layout holds
        # on every platform (vLLM ties it to the platforms where it maps /dev/shm)
        return True

    @property
    def region_geometry(self) -> RegionGeometry:
        return RegionGeometry(
            num_chunks=self.num_chunks,
            row_stride=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
            num_workers=self.config.parallel.world_size,
            replicated=self.replicated_layout,
        )

    def create_worker(self, kv_caches: CanonicalKVCaches) -> KvshmOffloadingWorker:
        settings = self.settings
        if METRICS_DIR_ENV not in os.environ:
            log.info(
                "kvshm: %s is not set, so kvshm's transfer metrics stay in this worker "
                "process and do not reach vLLM's /metrics (docs/vllm-plugin.md)",
                METRICS_DIR_ENV,
            )
        region = attach_region(
            settings.region_dir,
            settings.instance_id,
            self.region_geometry,
            self.config.parallel.rank,
            settings.attach_timeout_s,
        )
        try:
            return KvshmOffloadingWorker(
                kv_caches,
                region,
                self.blocks_per_chunk,
                region_dir=settings.region_dir,
                instance_id=settings.instance_id,
                pin=settings.pin,
                backend=settings.backend,
                calibration=calibration_cache(settings),
                # with the replicated layout only rank 0 stores (vLLM's connector decides)
                stores=not self.replicated_layout or self.config.parallel.rank == 0,
            )
        except BaseException:
            region.cleanup()
            raise

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        worker: OffloadingWorker | None = getattr(self, "_worker", None)
        if worker is None:
            worker = self._worker = self.create_worker(kv_caches)
        return worker
