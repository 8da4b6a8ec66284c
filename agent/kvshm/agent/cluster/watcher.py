"""List, then watch, one kind of object in a thread of its own; keep the latest of each.

Every (re)list replaces the cache whole, so a missed event never lingers; a watch that ends early
(the API server restarted, or 410 Gone: the resource version is too old) counts as a restart and
is followed by a fresh list after a short backoff.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from kvshm.api import region_key

log = logging.getLogger(__name__)

Obj = dict[str, Any]
ListFn = Callable[..., Any]

WATCH_TIMEOUT_SECONDS = 300
MAX_BACKOFF_SECONDS = 30.0


def essence(obj: Mapping[str, Any] | None) -> tuple[Any, ...] | None:
    """What the agent acts on. Status is not in it: every agent's status patch is a MODIFIED
    event for every agent, and must not wake them all."""
    if obj is None:
        return None
    metadata = obj.get("metadata") or {}
    return (obj.get("spec"), metadata.get("uid"), metadata.get("deletionTimestamp"))


def object_key(obj: Mapping[str, Any]) -> str:
    metadata = obj.get("metadata") or {}
    namespace = metadata.get("namespace")
    name = str(metadata.get("name", ""))
    return region_key(namespace, name) if namespace else name


class ListWatch:
    """Keeps `items` (key -> latest object) of one list call's results up to date."""

    def __init__(
        self,
        what: str,
        list_fn: ListFn,
        list_kwargs: Mapping[str, Any],
        *,
        on_change: Callable[[], None],
        on_restart: Callable[[], None],
        watch_timeout_seconds: int = WATCH_TIMEOUT_SECONDS,
    ) -> None:
        self.what = what
        self._list_fn = list_fn
        self._list_kwargs = dict(list_kwargs)
        self._on_change = on_change
        self._on_restart = on_restart
        self._watch_timeout = watch_timeout_seconds
        self._lock = threading.Lock()
        self._items: dict[str, Obj] = {}
        self._synced = threading.Event()
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self.last_error = ""

    @property
    def synced(self) -> bool:
        return self._synced.is_set()

    def items(self) -> dict[str, Obj]:
        with self._lock:
            return dict(self._items)

    def start(self) -> None:
        threading.Thread(target=self._run, name=f"kvshm-watch-{self.what}", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()

    def _run(self) -> None:
        backoff = 1.0
        while not self._stop.is_set():
            try:
                version = self._relist()
                self.last_error = ""
                backoff = 1.0
                while not self._stop.is_set():
                    started = time.monotonic()
                    version = self._watch_from(version)
                    if time.monotonic() - started < self._watch_timeout - 1:
                        raise ConnectionError("the watch stream ended early")
            except Exception as exc:  # an API server going away must not end the watch
                if self._stop.is_set():
                    return
                self.last_error = f"watching {self.what} failed ({_describe(exc)}); re-listing"
                log.warning("%s", self.last_error)
                self._on_restart()
                self._stop.wait(backoff)
                backoff = min(MAX_BACKOFF_SECONDS, backoff * 2)

    def _relist(self) -> str:
        listing = self._list_fn(**self._list_kwargs, _request_timeout=30)
        items = {object_key(obj): obj for obj in listing.get("items") or []}
        with self._lock:
            self._items = items
        self._synced.set()
        self._on_change()
        return str((listing.get("metadata") or {}).get("resourceVersion", ""))

    def _watch_from(self, version: str) -> str:
        self._watch = watch.Watch()
        stream: Iterator[dict[str, Any]] = self._watch.stream(
            self._list_fn,
            **self._list_kwargs,
            resource_version=version,
            timeout_seconds=self._watch_timeout,
            allow_watch_bookmarks=True,
        )
        for event in stream:
            obj = event.get("raw_object") or {}
            version = str((obj.get("metadata") or {}).get("resourceVersion", version))
            kind = event.get("type")
            key = object_key(obj)
            with self._lock:
                before = self._items.get(key)
                if kind in ("ADDED", "MODIFIED"):
                    self._items[key] = obj
                elif kind == "DELETED":
                    self._items.pop(key, None)
                else:
                    continue  # BOOKMARK: only the resource version moves
            if kind == "DELETED" or essence(before) != essence(obj):
                self._on_change()
        return version


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"
