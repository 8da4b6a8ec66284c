"""The event log behind watches: every change gets the next resourceVersion and is kept in order.

A watch from resourceVersion N replays the logged events after N and then follows live ones;
the replay and the subscription happen in one step of the event loop, so no event is lost
between them and none is delivered twice.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Matcher = Callable[[Mapping[str, Any]], bool]
STOP = None  # put into a watcher's queue to end its stream


@dataclass(frozen=True)
class Change:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    store_key: tuple[str, str]  # (group, plural): all versions of a resource share one store
    namespace: str | None
    obj: Mapping[str, Any]
    old: Mapping[str, Any] | None  # the previous state, to tell selector transitions


@dataclass(eq=False)
class Watcher:
    store_key: tuple[str, str]
    namespace: str | None
    matches: Matcher
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)

    def event_for(self, change: Change) -> dict[str, Any] | None:
        """The event this watcher sees for a change, as the API server filters by selectors."""
        if change.store_key != self.store_key:
            return None
        if self.namespace is not None and change.namespace != self.namespace:
            return None
        now = self.matches(change.obj)
        before = change.old is not None and self.matches(change.old)
        if change.type == "MODIFIED" and now != before:
            kind = "ADDED" if now else "DELETED"  # entering or leaving the selection
        elif now or (change.type == "DELETED" and before):
            kind = change.type
        else:
            return None
        return {"type": kind, "object": copy.deepcopy(dict(change.obj))}


class EventLog:
    def __init__(self, capacity: int = 20000) -> None:
        self._changes: list[Change] = []
        self._capacity = capacity
        self.floor_rv = 0  # events at or below it are gone: a watch from before it gets 410
        self._watchers: set[Watcher] = set()

    def append(self, change: Change) -> None:
        self._changes.append(change)
        if len(self._changes) > self._capacity:
            dropped = self._changes[: len(self._changes) - self._capacity]
            self._changes = self._changes[len(dropped) :]
            self.floor_rv = dropped[-1].rv
        for watcher in list(self._watchers):
            event = watcher.event_for(change)
            if event is not None:
                watcher.queue.put_nowait(event)

    def compact(self, rv: int) -> None:
        """Forget every change up to rv, as etcd compaction does."""
        self._changes = [c for c in self._changes if c.rv > rv]
        self.floor_rv = max(self.floor_rv, rv)

    def replay(self, watcher: Watcher, since_rv: int) -> list[dict[str, Any]]:
        events = (watcher.event_for(c) for c in self._changes if c.rv > since_rv)
        return [event for event in events if event is not None]

    def subscribe(self, watcher: Watcher) -> None:
        self._watchers.add(watcher)

    def unsubscribe(self, watcher: Watcher) -> None:
        self._watchers.discard(watcher)

    def close_all(self) -> int:
        """End every open watch stream (as an API server restart would); returns how many."""
        watchers = list(self._watchers)
        for watcher in watchers:
            watcher.queue.put_nowait(STOP)
        return len(watchers)
