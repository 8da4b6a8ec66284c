"""Drain events written from a separate process, so no tenant can crash the agent.

Workers must write their read flags into a region's event ring, so a tenant can also truncate
the ring file, and whoever then touches the mapping dies of SIGBUS. The agent therefore never
maps a ring: one child process (spawned, a fresh interpreter: the agent is threaded) holds the
writer end of every region's ring and does every write, receiving each region directory as a
descriptor over a Unix socket. If the child dies, the next call starts another, which resumes the
rings of the regions still open; a watchdog thread does the same as soon as a child dies between
calls, so workers of other regions see their writer back within their grace period. A region
whose call was in flight when the child died gets no more events (its tenant may be the one that
truncated its ring). Events are best-effort either
way: holder probes and the grace period, not events, decide when a region's files go.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import threading
from multiprocessing import reduction
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from kvshm.agent.drain.notify import RegionEventQueues
from kvshm.agent.root.saferoot import RegionDir
from kvshm.api import OffloadRegion
from kvshm.region.drain_event import EVENTS_RING, DrainEvent

log = logging.getLogger(__name__)

REPLY_TIMEOUT_SECONDS = 10.0  # prepare and publish each wait at most about a second inside
JOIN_SERVICE_SECONDS = 0.5  # how soon a worker's join is accepted when no event is being sent


class _ReceivedDirectory:
    """A region directory as the child sees it: a descriptor it was sent."""

    def __init__(self, key: str, fd: int) -> None:
        self.key = key
        self.fd = fd

    @property
    def fd_path(self) -> str:
        return f"/proc/self/fd/{self.fd}"

    def lstat(self, file_name: str) -> os.stat_result | None:
        try:
            return os.stat(file_name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None


def serve(conn: Connection) -> None:
    """The child: apply each (command, key, payload) to its queues; exit when the agent goes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the agent's; EOF ends us
    queues = RegionEventQueues()
    while True:
        try:
            if not conn.poll(JOIN_SERVICE_SECONDS):
                # accept workers' joins between events, so their wait_until_ready returns
                queues.serve_joins()
                continue
            command, key, payload = conn.recv()
        except EOFError:
            # The agent stopped. Leave without running finalizers: they would remove the rings
            # this process created, and regions (with their rings) outlive the agent.
            os._exit(0)
        directory = _ReceivedDirectory(key, reduction.recv_handle(conn))
        reply = ("ok", "")
        try:
            if command == "prepare":
                queues.prepare(directory, payload)
            elif command == "publish":
                queues.publish(directory, payload)
            else:
                queues.close(directory)
        except Exception as exc:  # reported to the agent, which logs it; the child goes on
            reply = ("error", f"{type(exc).__name__}: {exc}")
        finally:
            os.close(directory.fd)
        # only now: once the agent has the reply, this process holds nothing of the directory
        conn.send(reply)


class IsolatedEventQueues:
    """The agent's DrainNotifier: RegionEventQueues run in a child process."""

    def __init__(self, reply_timeout: float = REPLY_TIMEOUT_SECONDS) -> None:
        self._context = multiprocessing.get_context("spawn")
        self._reply_timeout = reply_timeout
        self._process: BaseProcess | None = None
        self._conn: Connection | None = None
        self._open: dict[str, tuple[int, OffloadRegion]] = {}  # key -> (own dir fd, region)
        self._broken: set[str] = set()
        self._lock = threading.RLock()  # one call at a time; the watchdog restarts under it
        self._stopping = False
        # at interpreter exit multiprocessing terminates the child: that is no death to repair
        atexit.register(self._mark_stopping)

    def _mark_stopping(self) -> None:
        self._stopping = True

    @property
    def writer_pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def prepare(self, region_dir: RegionDir, region: OffloadRegion) -> None:
        """Make (or resume) the region's ring; again for an open region whose spec.access
        changed, so the ring gets the new owner and mode."""
        key = region_dir.key
        with self._lock:
            if key in self._broken:
                return
            entry = self._open.get(key)
            if entry is not None:
                if entry[1].access != region.access:
                    self._call("prepare", key, region_dir.fd, region)
                    self._open[key] = (entry[0], region)
                return
            self._call("prepare", key, region_dir.fd, region)
            self._open[key] = (os.dup(region_dir.fd), region)

    def publish(self, region_dir: RegionDir, event: DrainEvent) -> None:
        with self._lock:
            if region_dir.key in self._broken:
                log.warning(
                    "region %s: its event ring broke the event writer; no event", region_dir.key
                )
                return
            self._call("publish", region_dir.key, region_dir.fd, event)

    def close(self, region_dir: RegionDir) -> None:
        key = region_dir.key
        with self._lock:
            entry = self._open.pop(key, None)
            if entry is not None:
                os.close(entry[0])
                if key not in self._broken and self.writer_running():
                    self._call("close", key, region_dir.fd, None)
            self._broken.discard(key)

    def file_names(self, region_dir: RegionDir) -> list[str]:
        return [EVENTS_RING]

    def shutdown(self) -> None:
        """Stop the child (the rings stay; a restarted agent resumes them)."""
        with self._lock:
            self._stopping = True
            if self._conn is not None:
                self._conn.close()  # the child exits on EOF, leaving its rings in place
            if self._process is not None:
                self._process.join(5)
            self._stop_dead_child()
            for fd, _ in self._open.values():
                os.close(fd)
            self._open.clear()

    # -- the child ---------------------------------------------------------------------------

    def writer_running(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _call(self, command: str, key: str, dir_fd: int, payload: Any) -> None:
        if not self.writer_running():
            self._restart()
            if not self.writer_running():
                log.warning("region %s: no event writer running; no event %s", key, command)
                return
        try:
            reply = self._send(command, key, dir_fd, payload)
        except (EOFError, OSError, TimeoutError) as exc:
            self._lose(key, "died or hung while writing its ring", exc)
            return
        if reply[0] != "ok":
            log.warning("region %s: event %s failed: %s", key, command, reply[1])

    def _lose(self, key: str, what: str, exc: BaseException) -> None:
        """The child died (or hung) on this region's ring: the likeliest cause is that ring."""
        self._broken.add(key)
        self._stop_dead_child()
        log.warning(
            "region %s: the event writer %s (%s): no more events for this region; the writer "
            "restarts for the others",
            key,
            what,
            exc or type(exc).__name__,
        )

    def _send(self, command: str, key: str, dir_fd: int, payload: Any) -> tuple[str, str]:
        assert self._conn is not None and self._process is not None
        self._conn.send((command, key, payload))
        reduction.send_handle(self._conn, dir_fd, self._process.pid)
        if not self._conn.poll(self._reply_timeout):
            raise TimeoutError(f"no answer in {self._reply_timeout} s")
        reply: tuple[str, str] = self._conn.recv()
        return reply

    def _restart(self) -> None:
        """Start a child (after stopping a dead one) that takes over every open region's ring,
        so their workers keep a live writer."""
        if self._process is not None:
            dead = self._process
            # reap it first: its sentinel fires as its files close, a moment before the kernel
            # has an exit code to give
            self._stop_dead_child()
            log.warning("the event writer exited (code %s); starting another", dead.exitcode)
        ours, theirs = self._context.Pipe()
        process = self._context.Process(
            target=serve, args=(theirs,), name="kvshm-event-writer", daemon=True
        )
        process.start()
        theirs.close()
        self._process, self._conn = process, ours
        threading.Thread(
            target=self._watch, args=(process,), name="kvshm-event-writer-watch", daemon=True
        ).start()
        for key, (fd, region) in list(self._open.items()):
            if key not in self._broken:
                try:
                    self._send("prepare", key, fd, region)
                except (EOFError, OSError, TimeoutError) as exc:
                    self._lose(key, "died while resuming its ring", exc)
                    return

    def _watch(self, process: BaseProcess) -> None:
        """Replace a child that died between calls at once, so other regions keep a writer."""
        wait([process.sentinel])
        with self._lock:
            if not self._stopping and self._process in (process, None):
                self._restart()

    def _stop_dead_child(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._process is not None:
            self._process.kill()
            self._process.join()
        self._process, self._conn = None, None
