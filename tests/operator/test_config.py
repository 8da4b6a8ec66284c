"""Operator settings from the environment: defaults, overrides, and clear errors."""

from __future__ import annotations

import kopf
import pytest

from kvshm.operator.config import ConfigError, OperatorConfig, PeeringMode
from kvshm.operator.kopf_settings import configure


def test_defaults_without_environment() -> None:
    config = OperatorConfig.from_env({})
    assert config == OperatorConfig()
    assert config.orphan_dry_run is False and config.peering_mode is PeeringMode.AUTO


def test_overrides_by_field_name() -> None:
    config = OperatorConfig.from_env(
        {
            "KVSHM_OPERATOR_ORPHAN_GRACE_SECONDS": "30",
            "KVSHM_OPERATOR_ORPHAN_DRY_RUN": "true",
            "KVSHM_OPERATOR_MAX_WORKERS": "8",
            "KVSHM_OPERATOR_PEERING_MODE": "Standalone",
        }
    )
    assert config.orphan_grace_seconds == 30.0
    assert config.orphan_dry_run is True
    assert config.max_workers == 8
    assert config.peering_mode is PeeringMode.STANDALONE


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("KVSHM_OPERATOR_ORPHAN_GRACE_SECONDS", "ten", "a number of seconds"),
        ("KVSHM_OPERATOR_ORPHAN_DRY_RUN", "maybe", "true or false"),
        ("KVSHM_OPERATOR_PEERING_MODE", "solo", "auto | mandatory | standalone"),
        ("KVSHM_OPERATOR_AGENT_SILENCE_SECONDS", "-1", "must not be negative"),
        ("KVSHM_OPERATOR_MAX_WORKERS", "-1", "must not be negative"),
        ("KVSHM_OPERATOR_NODE_SWEEP_SECONDS", "0", "greater than 0"),
        # the watch's timeoutSeconds: the API server refuses "300.0" (400 on every watch)
        ("KVSHM_OPERATOR_WATCH_SERVER_TIMEOUT_SECONDS", "300.0", "an integer"),
    ],
)
def test_bad_values_name_the_variable_and_what_it_takes(
    variable: str, value: str, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected) as error:
        OperatorConfig.from_env({variable: value})
    assert variable in str(error.value)


def test_kopf_gets_no_worker_limit_by_default() -> None:
    """A limit below the objects of a kind at start-up deadlocks kopf (test_api_server has the
    cluster that did); 0 is none."""
    settings = kopf.OperatorSettings()
    configure(settings, OperatorConfig())
    assert settings.queueing.worker_limit is None
    configure(settings, OperatorConfig(max_workers=8))
    assert settings.queueing.worker_limit == 8
