"""The HTTP endpoints of the agent and the operator (/metrics, health): one bounded server, one
selector thread, hard limits; each process passes the routes it serves (docs/agent.md, "Metrics
and health")."""

from kvshm.endpoints.server import (
    MAX_CONNECTIONS,
    MAX_REQUEST_BYTES,
    REQUEST_TIMEOUT_SECONDS,
    RESPONSE_TIMEOUT_SECONDS,
    BoundedHttpServer,
    Reply,
    Route,
    check_route,
    metrics_route,
    serve,
)

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_REQUEST_BYTES",
    "REQUEST_TIMEOUT_SECONDS",
    "RESPONSE_TIMEOUT_SECONDS",
    "BoundedHttpServer",
    "Reply",
    "Route",
    "check_route",
    "metrics_route",
    "serve",
]
