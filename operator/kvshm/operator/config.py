"""The operator's tunables, from environment variables (the chart sets them; flags override).

Every value is validated when read, so a typo in the Deployment fails the start with the
variable's name and what it takes, instead of running with a silently wrong policy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum, StrEnum

ENV_PREFIX = "KVSHM_OPERATOR_"


class PeeringMode(StrEnum):
    """auto: peer if the peering object exists; mandatory: refuse to run without it."""

    AUTO = "auto"
    MANDATORY = "mandatory"
    STANDALONE = "standalone"


class ConfigError(ValueError):
    """A setting that cannot be used; the message names the variable and what it accepts."""


@dataclass(frozen=True)
class OperatorConfig:
    # Orphans: a file must stay unclaimed and unheld this long before a reclaim is requested.
    orphan_grace_seconds: float = 600.0
    orphan_dry_run: bool = False
    # An agent whose heartbeat is older than this is silent: regions there degrade, and a
    # deletion stops waiting for it (its files then surface as orphans when it returns).
    agent_silence_seconds: float = 120.0
    # How often a deleting region re-checks what time alone changes (an agent gone silent);
    # its agents' reports are acted on as they arrive.
    deletion_poll_seconds: float = 2.0
    # A status on the way (Pending, Provisioning, Terminating) waits this long for the next
    # report before it is written: a region Ready (or released) by then is written once.
    # After one is written, the next waits until region_resync_seconds after it.
    progress_write_seconds: float = 2.0
    # The regions' resync (on the sweep's ticks) and the OffloadNode timer (read once when the
    # handlers are registered: kopf fixes a timer's interval then).
    region_resync_seconds: float = 30.0
    node_sweep_seconds: float = 5.0
    # Runtime.
    metrics_port: int = 9465  # 0: no /metrics endpoint (the chart's default port)
    # Objects handled at once (0: no limit). kopf keeps a worker per object while its events
    # flow and for worker_idle_seconds after. A limit below the number of objects of any
    # watched kind at start-up deadlocks kopf: its first workers hold their slots waiting for
    # every object to be indexed, and the rest never get a slot (300 Nodes, 5,000 regions).
    max_workers: int = 0
    worker_idle_seconds: float = 1.0
    # An integer: kopf sends it as the watch's timeoutSeconds, which the API server parses as
    # an int (300.0 is a 400 Bad Request for every watch, and the operator cannot start).
    watch_server_timeout_seconds: int = 300
    watch_client_timeout_seconds: float = 330.0
    peering_name: str = "kvshm-operator"
    peering_mode: PeeringMode = PeeringMode.AUTO

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if isinstance(value, int | float) and not isinstance(value, bool) and value < 0:
                raise ConfigError(f"{_env_name(item.name)} must not be negative, got {value}")
        for name in ("region_resync_seconds", "node_sweep_seconds", "deletion_poll_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{_env_name(name)} must be greater than 0")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> OperatorConfig:
        """Defaults, overridden by KVSHM_OPERATOR_<FIELD> variables (..._ORPHAN_GRACE_SECONDS)."""
        environ = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for item in fields(cls):
            raw = environ.get(_env_name(item.name))
            if raw is not None:
                values[item.name] = _convert(item.name, raw, type(getattr(cls(), item.name)))
        return cls(**values)  # type: ignore[arg-type]


def _env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _convert(name: str, raw: str, kind: type) -> object:
    text = raw.strip()
    try:
        if kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(text)
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        if issubclass(kind, Enum):
            return kind(text.lower())
        return text
    except ValueError:
        accepted = {
            bool: "true or false",
            int: "an integer",
            float: "a number of seconds",
        }.get(kind) or (
            " | ".join(str(member.value) for member in kind) if issubclass(kind, Enum) else "text"
        )
        raise ConfigError(f"{_env_name(name)}={raw!r} is not valid: expected {accepted}") from None
