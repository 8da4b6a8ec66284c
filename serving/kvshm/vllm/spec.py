"""KvshmOffloadingSpec: vLLM 0.33's CPU offloading, on the kvshm agent's region.

The geometry (num_chunks, kv_bytes_per_chunk padded to 4096, cpu_page_size_per_worker,
replicated layout) is vLLM's own: the spec inherits it from CPUOffloadingSpec. The worker
attaches the agent's region instead of creating one and moves blocks with kvshm's transfer
handlers; the scheduler side is vLLM's CPUOffloadingManager keeping the region's warm-restart
index (kvshm.vllm.warm, docs/warm-restart.md).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from kvshm.region import region_file_name
from kvshm.transfer import ChoiceCache
from kvshm.vllm.attach import attach_region
from kvshm.vllm.geometry import RegionGeometry
from kvshm.vllm.settings import WARM_RESTART_KEY, PluginConfigError, PluginSettings
from kvshm.vllm.warm.identity import engine_identity, find_vllm_config
from kvshm.vllm.warm.manager import KvshmOffloadingManager, WarmStart, metric_definitions
from kvshm.vllm.worker import KvshmOffloadingWorker
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

log = logging.getLogger(__name__)

METRICS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def calibration_cache(settings: PluginSettings) -> ChoiceCache | None:
    if not settings.calibrate:
        return None
    return ChoiceCache(Path(settings.cache_dir)) if settings.cache_dir else ChoiceCache()


class KvshmOffloadingSpec(CPUOffloadingSpec):
    _manager: OffloadingManager | None  # CPUOffloadingSpec's (vLLM's types are Any here)

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        return {**super().build_metric_definitions(extra_config), **metric_definitions()}

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
        # vLLM's OffloadingConnector, building this spec, holds the engine's whole config: the
        # warm-restart identity needs more of it than the OffloadingConfig carries
        self._vllm_config = find_vllm_config() if self.settings.warm_restart else None

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

    def get_manager(self) -> OffloadingManager:
        if not self._manager:
            extra = self.extra_config
            self._manager = KvshmOffloadingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                # vLLM's CPUOffloadingSpec.get_manager reads these two so (0: no threshold)
                store_threshold=int(extra.get("store_threshold", 0)),
                max_tracker_size=int(extra.get("max_tracker_size", 64_000)),
                info=self.cpu_info,
                warm=self.warm_start() if self.num_chunks > 0 else None,
            )
        return self._manager

    def warm_start(self) -> WarmStart:
        """Where the region's index is and the identity it must hold, or why warm restart is
        off (the manager then invalidates any index it finds)."""
        settings = self.settings
        warm = WarmStart(settings.region_dir, settings.instance_id, None)
        if not settings.warm_restart:
            warm.off_reason = f"{WARM_RESTART_KEY} is false"
            return warm
        vllm_config = self._vllm_config
        if vllm_config is None:
            warm.off_reason = (
                "vLLM's engine config was not found (the spec was not built by vLLM's "
                "OffloadingConnector)"
            )
            return warm
        region_file = os.path.join(settings.region_dir, region_file_name(settings.instance_id))
        try:
            st = os.stat(region_file, follow_symlinks=False)
        except OSError as exc:
            warm.off_reason = f"the region file {region_file} cannot be read ({exc.strerror})"
            return warm
        identity = engine_identity(
            self.config,
            vllm_config,
            self.region_geometry,
            (st.st_dev, st.st_ino),
            settings.model_revision,
        )
        identity["cache.policy"] = self.eviction_policy
        if identity["model.weights"] is None and settings.model_revision is None:
            warm.off_reason = (
                f"the weights of model {vllm_config.model_config.model!r} could not be "
                f"identified (no local directory or Hugging Face cache snapshot holds them): "
                f"set kvshm_model_revision to a label of the weights"
            )
            return warm
        warm.identity = identity
        warm.hash_algorithm = str(vllm_config.cache_config.prefix_caching_hash_algo)
        return warm

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
