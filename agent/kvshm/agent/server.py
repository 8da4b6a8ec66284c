"""/metrics, /healthz and /readyz on one port, from one event-loop thread with hard limits.

Whoever can reach the port may be hostile (in cluster mode it listens on the pod's interfaces),
so nothing a client does can hold the agent's threads or descriptors: one thread serves every
connection through a selector; a connection costs one descriptor and at most MAX_REQUEST_BYTES
of buffer, must send its request within REQUEST_TIMEOUT_SECONDS and take its answer within
RESPONSE_TIMEOUT_SECONDS, and gets one answer per connection (Connection: close). At most
MAX_CONNECTIONS are open: a new one closes the longest-waiting one, so a kubelet probe always
gets in, however many idle connections someone keeps opening.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_SECONDS = 5.0
RESPONSE_TIMEOUT_SECONDS = 10.0
_TICK_SECONDS = 0.5
_TEXT = "text/plain; charset=utf-8"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


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


def _response(code: int, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {code} {_REASONS.get(code, '')}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


@dataclass
class _Connection:
    sock: socket.socket
    opened: float
    received: bytearray = field(default_factory=bytearray)
    pending: memoryview | None = None  # the answer still to send, once the request is in
    deadline: float = 0.0


class AgentHttpServer:
    """The agent's endpoints. serve() starts one; shutdown() then server_close() stop it."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: Health,
        *,
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT_SECONDS,
        response_timeout: float = RESPONSE_TIMEOUT_SECONDS,
    ) -> None:
        self._registry = registry
        self._health = health
        self._max_connections = max_connections
        self._request_timeout = request_timeout
        self._response_timeout = response_timeout
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, port))
            self._listener.listen(128)
            self._listener.setblocking(False)
        except BaseException:
            self._listener.close()
            raise
        self.server_address: tuple[str, int] = self._listener.getsockname()[:2]
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._open: dict[int, _Connection] = {}  # by descriptor, oldest first
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvshm-http", daemon=True)
        self.evicted = 0  # connections closed to make room (for tests and logs)

    @property
    def server_port(self) -> int:
        return self.server_address[1]

    @property
    def connections(self) -> int:
        return len(self._open)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def server_close(self) -> None:
        for conn in list(self._open.values()):
            self._close(conn)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(self._listener)
        self._listener.close()
        self._selector.close()

    # -- the loop --------------------------------------------------------------------------

    def _serve(self) -> None:
        while not self._stop.is_set():
            for key, events in self._selector.select(_TICK_SECONDS):
                try:
                    if key.fileobj is self._listener:
                        self._accept()
                    elif events & selectors.EVENT_READ:
                        self._read(self._open[key.fd])
                    else:
                        self._write(self._open[key.fd])
                except KeyError:
                    continue  # closed earlier in this same round
                except Exception:  # one broken connection must not stop the endpoint
                    log.exception("http: serving a connection failed")
                    if key.fd in self._open:
                        self._close(self._open[key.fd])
            self._expire(time.monotonic())

    def _accept(self) -> None:
        for _ in range(self._max_connections):  # a bounded batch per round
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the next round tries again
                log.warning("http: cannot accept a connection: %s", exc)
                return
            while len(self._open) >= self._max_connections:
                self.evicted += 1
                self._close(next(iter(self._open.values())))
            sock.setblocking(False)
            now = time.monotonic()
            conn = _Connection(sock, now, deadline=now + self._request_timeout)
            self._open[sock.fileno()] = conn
            self._selector.register(sock, selectors.EVENT_READ)

    def _read(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(MAX_REQUEST_BYTES + 1 - len(conn.received))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        conn.received += data
        end = conn.received.find(b"\r\n\r\n")
        if end < 0:
            end = conn.received.find(b"\n\n")
        if end >= 0:
            self._answer(conn, self._respond(bytes(conn.received[:end])))
        elif len(conn.received) > MAX_REQUEST_BYTES:
            self._answer(conn, _response(431, b"request too large\n", _TEXT))

    def _respond(self, head: bytes) -> bytes:
        parts = head.split(b"\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _response(400, b"bad request\n", _TEXT)
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _response(405, b"only GET\n", _TEXT)
        if target == b"/metrics":
            reply = _response(200, generate_latest(self._registry), CONTENT_TYPE_LATEST)
        elif target in (b"/healthz", b"/readyz"):
            ok, why = self._health.live() if target == b"/healthz" else self._health.ready()
            reply = _response(200 if ok else 503, (why + "\n").encode(), _TEXT)
        else:
            reply = _response(404, b"not found: try /metrics, /healthz or /readyz\n", _TEXT)
        if method == b"HEAD":
            reply = reply[: reply.index(b"\r\n\r\n") + 4]
        return reply

    def _answer(self, conn: _Connection, reply: bytes) -> None:
        conn.pending = memoryview(reply)
        conn.deadline = time.monotonic() + self._response_timeout
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Connection) -> None:
        assert conn.pending is not None
        try:
            sent = conn.sock.send(conn.pending)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.pending = conn.pending[sent:]
        if not conn.pending:
            self._close(conn)

    def _expire(self, now: float) -> None:
        for conn in [c for c in self._open.values() if c.deadline < now]:
            if conn.pending is None:  # sent nothing useful in time: say so, best effort
                with contextlib.suppress(OSError):
                    conn.sock.send(_response(408, b"request timeout\n", _TEXT))
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        fd = conn.sock.fileno()
        self._open.pop(fd, None)
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()


def serve(host: str, port: int, registry: CollectorRegistry, health: Health) -> AgentHttpServer:
    """Start serving in a daemon thread; the returned server's server_port is the real port."""
    server = AgentHttpServer(host, port, registry, health)
    server.start()
    return server
