"""GET routes on one port, from one event-loop thread with hard limits.

Whoever can reach the port may be hostile (the agent and the operator listen on their pods'
interfaces), so nothing a client does can hold the process's threads or descriptors: one thread
serves every connection through a selector; a connection costs one descriptor and at most
MAX_REQUEST_BYTES of buffer, must send its request within REQUEST_TIMEOUT_SECONDS and take its
answer within RESPONSE_TIMEOUT_SECONDS, and gets one answer per connection (Connection: close).
At most MAX_CONNECTIONS are open. A new connection at the cap first gets every request that has
already arrived read and answered; then, of the peer address holding the most connections that
have not sent a whole request, the longest-waiting one is closed (only when every connection is
being answered, the oldest answer). So a flood closes its own connections, and a kubelet probe,
which sends its request at once, is answered however fast someone opens silent connections.
"""

from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
MAX_REQUEST_BYTES = 8192
REQUEST_TIMEOUT_SECONDS = 5.0
RESPONSE_TIMEOUT_SECONDS = 10.0
_TICK_SECONDS = 0.5
TEXT = "text/plain; charset=utf-8"
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


@dataclass(frozen=True)
class Reply:
    status: int
    body: bytes
    content_type: str = TEXT


Route = Callable[[], Reply]


def metrics_route(registry: CollectorRegistry) -> Route:
    """The registry in the Prometheus text format 0.0.4."""
    return lambda: Reply(200, generate_latest(registry), CONTENT_TYPE_LATEST)


def check_route(check: Callable[[], tuple[bool, str]]) -> Route:
    """200 while check() says ok, else 503; the body is its reason."""

    def answer() -> Reply:
        ok, why = check()
        return Reply(200 if ok else 503, (why + "\n").encode())

    return answer


def _response(reply: Reply) -> bytes:
    head = (
        f"HTTP/1.1 {reply.status} {_REASONS.get(reply.status, '')}\r\n"
        f"Content-Type: {reply.content_type}\r\n"
        f"Content-Length: {len(reply.body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode("ascii") + reply.body


@dataclass
class _Connection:
    sock: socket.socket
    fd: int
    peer: str  # the client's address, without its port
    received: bytearray = field(default_factory=bytearray)
    pending: memoryview | None = None  # the answer still to send, once the request is in
    deadline: float = 0.0


class BoundedHttpServer:
    """routes by path; start() serves them, shutdown() then server_close() stop it."""

    def __init__(
        self,
        host: str,
        port: int,
        routes: Mapping[str, Route],
        *,
        thread_name: str = "kvshm-http",
        max_connections: int = MAX_CONNECTIONS,
        request_timeout: float = REQUEST_TIMEOUT_SECONDS,
        response_timeout: float = RESPONSE_TIMEOUT_SECONDS,
    ) -> None:
        self._routes = {path.encode("ascii"): route for path, route in routes.items()}
        self._not_found = Reply(404, f"not found: try {', '.join(routes)}\n".encode())
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
        # those that have not sent a whole request yet, by peer address, then as _open
        self._awaiting_request: dict[str, dict[int, _Connection]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=thread_name, daemon=True)
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
            self._handle(self._selector.select(_TICK_SECONDS), accepting=True)
            self._expire(time.monotonic())

    def _handle(
        self, ready: Iterable[tuple[selectors.SelectorKey, int]], *, accepting: bool
    ) -> None:
        for key, events in ready:
            if key.fileobj is self._listener:
                if accepting:
                    self._accept()
                continue
            conn = self._open.get(key.fd)
            if conn is None or conn.sock is not key.fileobj:
                continue  # closed earlier in this same round (its descriptor may be reused)
            try:
                if events & selectors.EVENT_READ:
                    self._read(conn)
                else:
                    self._write(conn)
            except Exception:  # one broken connection must not stop the endpoint
                log.exception("http: serving a connection failed")
                self._close(conn)

    def _accept(self) -> None:
        for _ in range(self._max_connections):  # a bounded batch per round
            try:
                sock, address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: the next round tries again
                log.warning("http: cannot accept a connection: %s", exc)
                return
            if len(self._open) >= self._max_connections:
                self._make_room()
            sock.setblocking(False)
            now = time.monotonic()
            conn = _Connection(
                sock, sock.fileno(), address[0], deadline=now + self._request_timeout
            )
            self._open[conn.fd] = conn
            self._awaiting_request.setdefault(conn.peer, {})[conn.fd] = conn
            self._selector.register(sock, selectors.EVENT_READ)

    def _make_room(self) -> None:
        # requests already in are answered (and their connections freed) before anyone is closed
        self._handle(self._selector.select(0), accepting=False)
        while len(self._open) >= self._max_connections:
            self.evicted += 1
            self._close(self._eviction_victim())

    def _eviction_victim(self) -> _Connection:
        if not self._awaiting_request:  # every connection is being answered
            return next(iter(self._open.values()))
        # the peer with the most (of two with as many, the one that has waited longest)
        flooding = max(
            self._awaiting_request.values(),
            key=lambda waiting: (len(waiting), -next(iter(waiting.values())).deadline),
        )
        return next(iter(flooding.values()))

    def _forget_awaiting(self, conn: _Connection) -> None:
        waiting = self._awaiting_request.get(conn.peer)
        if waiting is not None and waiting.pop(conn.fd, None) is not None and not waiting:
            del self._awaiting_request[conn.peer]

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
            self._answer(conn, _response(Reply(431, b"request too large\n")))

    def _respond(self, head: bytes) -> bytes:
        parts = head.split(b"\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _response(Reply(400, b"bad request\n"))
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return _response(Reply(405, b"only GET\n"))
        route = self._routes.get(target)
        reply = _response(route() if route is not None else self._not_found)
        if method == b"HEAD":
            reply = reply[: reply.index(b"\r\n\r\n") + 4]
        return reply

    def _answer(self, conn: _Connection, reply: bytes) -> None:
        self._forget_awaiting(conn)
        conn.pending = memoryview(reply)
        conn.deadline = time.monotonic() + self._response_timeout
        self._selector.modify(conn.sock, selectors.EVENT_WRITE)
        self._write(conn)

    def _write(self, conn: _Connection) -> None:
        if conn.pending is None:
            return
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
                    conn.sock.send(_response(Reply(408, b"request timeout\n")))
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        self._forget_awaiting(conn)
        if self._open.get(conn.fd) is conn:
            del self._open[conn.fd]
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()


def serve(
    host: str, port: int, routes: Mapping[str, Route], *, thread_name: str = "kvshm-http"
) -> BoundedHttpServer:
    """Start serving routes in a daemon thread; the returned server's server_port is the real
    port."""
    server = BoundedHttpServer(host, port, routes, thread_name=thread_name)
    server.start()
    return server
