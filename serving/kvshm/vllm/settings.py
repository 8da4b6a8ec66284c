"""The plugin's own keys in kv_connector_extra_config, read and checked once."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvshm.region import validate_instance_id
from kvshm.region.shared_region import DEFAULT_ATTACH_TIMEOUT_SECONDS, DEFAULT_DIRECTORY
from kvshm.transfer import BACKEND_NAMES, COPY_ENGINES

REGION_DIR_KEY = "kvshm_region_dir"
INSTANCE_ID_KEY = "kvshm_instance_id"
ATTACH_TIMEOUT_KEY = "kvshm_attach_timeout_s"
BACKEND_KEY = "kvshm_backend"
PIN_KEY = "kvshm_pin"
CALIBRATE_KEY = "kvshm_calibrate"
CACHE_DIR_KEY = "kvshm_cache_dir"
WARM_RESTART_KEY = "kvshm_warm_restart"
MODEL_REVISION_KEY = "kvshm_model_revision"
KEYS = (
    REGION_DIR_KEY,
    INSTANCE_ID_KEY,
    ATTACH_TIMEOUT_KEY,
    BACKEND_KEY,
    PIN_KEY,
    CALIBRATE_KEY,
    CACHE_DIR_KEY,
    WARM_RESTART_KEY,
    MODEL_REVISION_KEY,
)
KEY_PREFIX = "kvshm_"


class PluginConfigError(ValueError):
    """A kvshm key in kv_connector_extra_config has a value the plugin cannot use."""


def _flag(value: object, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise PluginConfigError(f"{key} must be true or false, got {value!r}")


def _absolute_path(value: object, key: str, hint: str = "") -> str:
    if isinstance(value, str) and value.startswith("/"):
        return value
    raise PluginConfigError(f"{key} must be an absolute path, got {value!r}{hint}")


def _seconds(value: object, key: str) -> float:
    seconds = math.nan
    # bool is an int to Python, but `true` is no number of seconds
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            seconds = float(value)
    if 0 <= seconds < math.inf:  # never NaN; "inf" would wait forever for a missing region
        return seconds
    raise PluginConfigError(f"{key} must be a finite number of seconds >= 0, got {value!r}")


def _refuse_unknown_keys(extra: Mapping[str, Any]) -> None:
    """A misspelt kvshm key would otherwise leave its setting at the default, unnoticed."""
    unknown = sorted(k for k in extra if k.startswith(KEY_PREFIX) and k not in KEYS)
    if unknown:
        raise PluginConfigError(
            f"unknown kvshm keys in kv_connector_extra_config: {', '.join(unknown)}; "
            f"the plugin's keys are {', '.join(KEYS)}"
        )


@dataclass(frozen=True)
class PluginSettings:
    region_dir: str
    """Directory holding the agent's region file (the pod's mount of the region directory)."""
    instance_id: str
    """The region's instanceId: vLLM's engine_id unless kvshm_instance_id is given."""
    attach_timeout_s: float
    backend: str | None
    """Force one kvshm copy backend (dma, kernel, staged, strided); None chooses per job;
    copy-engines chooses among those that use no SMs (dma, strided)."""
    pin: bool
    """Register the region with CUDA (in the background; the first transfer waits for it)."""
    calibrate: bool = True
    """Choose each direction's backend by measuring on this host (kvshm.transfer.calibration)."""
    cache_dir: str | None = None
    """Where the measured choices are kept: an absolute path (None: ~/.cache/kvshm)."""
    warm_restart: bool = True
    """Keep the region's warm-restart index, so a restarted engine starts with the chunks the
    region holds (docs/warm-restart.md)."""
    model_revision: str | None = None
    """A label of the model's weights, part of the warm-restart identity beside what the plugin
    finds itself (the weights' revision where it cannot find one)."""

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any], engine_id: str, dp_index: int, dp_size: int
    ) -> PluginSettings:
        _refuse_unknown_keys(extra)
        region_dir = _absolute_path(extra.get(REGION_DIR_KEY, DEFAULT_DIRECTORY), REGION_DIR_KEY)
        given = extra.get(INSTANCE_ID_KEY)
        if given is None:
            instance_id = engine_id  # vLLM already appended _dp<rank> under data parallelism
            source = f"vLLM's engine_id {engine_id!r} (set {INSTANCE_ID_KEY} to the region's)"
        elif not isinstance(given, str):
            raise PluginConfigError(
                f"{INSTANCE_ID_KEY} must be a string (the region's instanceId), got {given!r}"
            )
        else:
            # the same rule vLLM applies to engine_id, so one setting serves every DP engine
            instance_id = f"{given}_dp{dp_index}" if dp_size > 1 else given
            source = f"{INSTANCE_ID_KEY} {given!r}"
        try:
            validate_instance_id(instance_id)
        except ValueError as exc:
            raise PluginConfigError(f"{source} is no region instance id: {exc}") from exc
        timeout = _seconds(
            extra.get(ATTACH_TIMEOUT_KEY, DEFAULT_ATTACH_TIMEOUT_SECONDS), ATTACH_TIMEOUT_KEY
        )
        cache_dir = extra.get(CACHE_DIR_KEY)
        if cache_dir is not None:
            cache_dir = _absolute_path(
                cache_dir,
                CACHE_DIR_KEY,
                f"; leave it out for ~/.cache/kvshm, or set {CALIBRATE_KEY}: false to choose the "
                f"copy backends by block size without measuring",
            )
        backend = extra.get(BACKEND_KEY)
        if backend not in (None, "", "auto", COPY_ENGINES, *BACKEND_NAMES):
            raise PluginConfigError(
                f"{BACKEND_KEY} must be one of auto, {COPY_ENGINES}, {', '.join(BACKEND_NAMES)}; "
                f"got {backend!r}"
            )
        model_revision = extra.get(MODEL_REVISION_KEY)
        if model_revision is not None and not (
            isinstance(model_revision, str) and 0 < len(model_revision) <= 256
        ):
            raise PluginConfigError(
                f"{MODEL_REVISION_KEY} must be a string of 1 to 256 characters (a label of the "
                f"model's weights, such as their revision), got {model_revision!r}"
            )
        return cls(
            region_dir=region_dir,
            instance_id=instance_id,
            attach_timeout_s=timeout,
            backend=None if backend in (None, "", "auto") else str(backend),
            pin=_flag(extra.get(PIN_KEY, True), PIN_KEY),
            calibrate=_flag(extra.get(CALIBRATE_KEY, True), CALIBRATE_KEY),
            cache_dir=cache_dir,
            warm_restart=_flag(extra.get(WARM_RESTART_KEY, True), WARM_RESTART_KEY),
            model_revision=model_revision,
        )
