"""The API server's audit log, read back: which user wrote (or asked for) what.

kube-apiserver writes one JSON line per request stage to --audit-log-path under the policy
EnvTest starts it with (`AuditPolicy`). Read back, every request counts once, at the stage it
completed, so a test can count the writes each client made to each object, and a benchmark the
requests a client makes while nothing changes.
"""

from __future__ import annotations

import enum
import json
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvshm.api import GROUP, REGION_KIND, REGION_PLURAL

WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
# a request counts when the server finished it (a watch: when it ended)
FINAL_STAGES = frozenset({"ResponseComplete", "Panic"})


class AuditPolicy(enum.Enum):
    """What the server records (None in EnvTest: no audit log, the fastest server)."""

    # writes of kvshm.dev objects and of Events, by any user: what the write budget counts
    WRITES = "writes"
    # every request by any user but the admin (who sets up and polls): also reads and watches
    REQUESTS = "requests"


def service_account_user(namespace: str, name: str) -> str:
    """The user name a ServiceAccount's token authenticates as."""
    return f"system:serviceaccount:{namespace}:{name}"


def policy_document(policy: AuditPolicy, admin: str) -> dict[str, Any]:
    """The audit.k8s.io/v1 Policy for `policy`; Events at Request level, so that each is
    attributed to the object it is about (involvedObject)."""
    writes = sorted(WRITE_VERBS)
    events = {"group": "", "resources": ["events"]}
    rules: list[dict[str, Any]] = [{"level": "None", "users": [admin]}]
    if policy is AuditPolicy.WRITES:
        rules += [
            {"level": "Request", "verbs": writes, "resources": [events]},
            {"level": "Metadata", "verbs": writes, "resources": [{"group": GROUP}]},
        ]
    else:
        rules += [
            {"level": "Request", "verbs": writes, "resources": [events]},
            {"level": "Metadata"},
        ]
    rules.append({"level": "None"})
    return {
        "apiVersion": "audit.k8s.io/v1",
        "kind": "Policy",
        "omitStages": ["RequestReceived"],
        "rules": rules,
    }


@dataclass(frozen=True)
class AuditEntry:
    """One request, as the server recorded it when it completed."""

    user: str
    verb: str
    resource: str  # "" for a non-resource URL
    subresource: str
    namespace: str
    name: str
    code: int
    time: datetime  # when the server finished it
    about: tuple[str, str, str] | None  # an Event's involvedObject: (kind, namespace, name)

    @property
    def is_write(self) -> bool:
        return self.verb in WRITE_VERBS

    @property
    def region(self) -> tuple[str, str] | None:
        """(namespace, name) of the OffloadRegion this request wrote, or an Event is about."""
        if self.resource == REGION_PLURAL and self.name:
            return (self.namespace, self.name)
        if self.about is not None and self.about[0] == REGION_KIND:
            return (self.about[1], self.about[2])
        return None


def _entry(line: dict[str, Any]) -> AuditEntry:
    ref = line.get("objectRef") or {}
    involved = ((line.get("requestObject") or {}).get("involvedObject")) or None
    return AuditEntry(
        user=str((line.get("user") or {}).get("username", "")),
        verb=str(line.get("verb", "")),
        resource=str(ref.get("resource", "")),
        subresource=str(ref.get("subresource", "")),
        namespace=str(ref.get("namespace", "")),
        name=str(ref.get("name", "")),
        code=int((line.get("responseStatus") or {}).get("code") or 0),
        time=datetime.fromisoformat(str(line["stageTimestamp"]).replace("Z", "+00:00")),
        about=(
            None
            if involved is None
            else (
                str(involved.get("kind", "")),
                str(involved.get("namespace", "")),
                str(involved.get("name", "")),
            )
        ),
    )


class AuditLog:
    """The server's audit log file; `mark()` and `entries(since)` read what came after."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def mark(self) -> int:
        """A point in the log: entries(since=mark) reads only what the server logged after."""
        return self.path.stat().st_size if self.path.exists() else 0

    def entries(self, since: int = 0) -> list[AuditEntry]:
        return list(self._read(since))

    def settled(
        self, since: int, user: str, quiet: float = 1.0, timeout: float = 30.0
    ) -> list[AuditEntry]:
        """entries(since) once `user`'s requests stopped coming for `quiet` seconds: the server
        logs a request when its response is complete, which may be after a client saw its
        effect (other users, say agents' heartbeats, may go on meanwhile)."""
        deadline = time.monotonic() + timeout
        count = -1
        while True:
            entries = self.entries(since)
            mine = sum(1 for entry in entries if entry.user == user)
            if mine == count or time.monotonic() > deadline:
                return entries
            count = mine
            time.sleep(quiet)

    def _read(self, since: int) -> Iterator[AuditEntry]:
        if not self.path.exists():
            return
        if self.path.stat().st_size < since:
            raise RuntimeError(f"{self.path} is shorter than mark {since}: rotated?")
        with self.path.open("rb") as log:
            log.seek(since)
            for raw in log:
                if not raw.endswith(b"\n"):
                    return  # a line the server is still writing
                line = json.loads(raw)
                if line.get("stage") in FINAL_STAGES:
                    yield _entry(line)


def writes_by_region(entries: Iterable[AuditEntry], user: str) -> Counter[tuple[str, str]]:
    """How many writes `user` made to each OffloadRegion (any subresource) or Events about it,
    refused ones included: each is a request the server and etcd had to serve."""
    counts: Counter[tuple[str, str]] = Counter()
    for entry in entries:
        region = entry.region
        if entry.is_write and entry.user == user and region is not None:
            counts[region] += 1
    return counts


def describe(entries: Iterable[AuditEntry], user: str) -> Counter[str]:
    """`user`'s writes by `verb resource[/subresource] code`: what a count above is made of."""
    return Counter(
        f"{e.verb} {e.resource}{'/' + e.subresource if e.subresource else ''} {e.code}"
        for e in entries
        if e.is_write and e.user == user
    )
