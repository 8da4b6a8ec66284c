"""/metrics, /healthz and /readyz on one port, from a small threaded HTTP server."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


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


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    health: Health

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        elif path in ("/healthz", "/readyz"):
            ok, why = self.health.live() if path == "/healthz" else self.health.ready()
            self._send(200 if ok else 503, (why + "\n").encode(), "text/plain; charset=utf-8")
        else:
            self._send(404, b"not found: try /metrics, /healthz or /readyz\n", "text/plain")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # scrapes every few seconds would drown the agent's own log


def serve(host: str, port: int, registry: CollectorRegistry, health: Health) -> ThreadingHTTPServer:
    """Start serving in a daemon thread; the returned server's server_port is the real port."""
    handler = type("AgentHandler", (_Handler,), {"registry": registry, "health": health})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="kvshm-http", daemon=True).start()
    return server
