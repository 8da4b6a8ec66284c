"""The agent's endpoints: /metrics, /healthz (alive while reconcile passes keep completing) and
/readyz (after the first), on one port, through kvshm.endpoints' bounded server."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry

from kvshm.endpoints import BoundedHttpServer, Route, check_route, metrics_route
from kvshm.endpoints import serve as serve_routes


class Health:
    """Alive while reconcile passes keep completing; ready after the first one."""

    def __init__(self, stale_after_seconds: float) -> None:
        self._stale_after = stale_after_seconds
        self._last_pass: float | None = None
        self._started = time.monotonic()

    def passed(self) -> None:
        self._last_pass = time.monotonic()

    def live(self) -> tuple[bool, str]:
        reference = self._last_pass if self._last_pass is not None else self._started
        age = time.monotonic() - reference
        if age > self._stale_after:
            return False, f"no reconcile pass completed for {age:.0f}s"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        if self._last_pass is None:
            return False, "the first reconcile pass has not completed yet"
        return self.live()


def agent_routes(registry: CollectorRegistry, health: Health) -> dict[str, Route]:
    return {
        "/metrics": metrics_route(registry),
        "/healthz": check_route(health.live),
        "/readyz": check_route(health.ready),
    }


def serve(host: str, port: int, registry: CollectorRegistry, health: Health) -> BoundedHttpServer:
    """Start serving in a daemon thread; the returned server's server_port is the real port."""
    return serve_routes(host, port, agent_routes(registry, health), thread_name="kvshm-agent-http")
