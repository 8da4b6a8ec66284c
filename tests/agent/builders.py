"""Small builders shared by the agent tests: regions, views, a reconciler on a real tmpfs root."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from kvshm.agent.hosting import HostingSettings
from kvshm.agent.reconciler import NodeReconciler, ReconcilerSettings
from kvshm.agent.reports import PassResult
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.root.saferoot import RegionDir, RegionRoot
from kvshm.agent.view import ClusterView, KnownRegion
from kvshm.api import OffloadRegion, ReclaimRequest, parse_offload_region
from kvshm.region.drain_event import DrainEvent

MIB = 1024 * 1024
NODE = "node-a"
WRITTEN = datetime(2026, 11, 22, 12, 0, 0, tzinfo=UTC)


def manifest(
    name: str = "r1",
    namespace: str = "ns1",
    *,
    blocks: int = 16,
    page: int = 65536,
    workers: int = 2,
    **spec: Any,
) -> dict[str, Any]:
    return {
        "apiVersion": "kvshm.dev/v1alpha1",
        "kind": "OffloadRegion",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{namespace}-{name}"},
        "spec": {
            "layout": {"numBlocks": blocks, "cpuPageSize": page, "numWorkers": workers},
            **spec,
        },
    }


def region(name: str = "r1", namespace: str = "ns1", **kwargs: Any) -> OffloadRegion:
    return parse_offload_region(manifest(name, namespace, **kwargs))


def region_dir(root: Path, key: str = "ns1/r1") -> Path:
    """<root>/<namespace>/<name>/ made by hand (as a tenant or an earlier run left it)."""
    directory = root / key
    directory.mkdir(parents=True)
    for each in (root, directory.parent):
        os.chmod(each, 0o711)
    return directory


def reclaim(path: str, written: int = 0, size: int | None = None) -> ReclaimRequest:
    """A spec.reclaims entry, written `written` seconds after WRITTEN (another time: a request
    written again, which the agent executes again)."""
    return ReclaimRequest(path, size, WRITTEN + timedelta(seconds=written), "orphaned")


def view(
    *regions: OffloadRegion,
    deleting: tuple[str, ...] = (),
    reported: tuple[str, ...] = (),
    **kwargs: Any,
) -> ClusterView:
    """The regions as a source sees them: `deleting` keys have a deletionTimestamp, `reported`
    keys a status.nodes.<NODE> entry that is not Removed."""
    known = {r.key: KnownRegion(r, r.key in deleting, r.key in reported) for r in regions}
    return ClusterView(NODE, kwargs.pop("labels", {}), known, **kwargs)


class RecordingNotifier:
    """Records drain events; makes one file in the region directory, as a queue would."""

    FILE = "kvshm_events_test"

    def __init__(self) -> None:
        self.events: list[tuple[str, DrainEvent]] = []
        self.prepared: list[str] = []
        self.closed: list[str] = []

    def prepare(self, region_dir: RegionDir, region: OffloadRegion) -> None:
        self.prepared.append(region.key)

    def close(self, region_dir: RegionDir) -> None:
        self.closed.append(region_dir.key)

    def publish(self, region_dir: RegionDir, event: DrainEvent) -> None:
        self.events.append((region_dir.key, event))
        fd = os.open(
            self.FILE, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600, dir_fd=region_dir.fd
        )
        os.close(fd)

    def file_names(self, region_dir: RegionDir) -> list[str]:
        return [self.FILE]


def make_reconciler(
    root: Path,
    *,
    notifier: RecordingNotifier | None = None,
    proc_scan: bool = False,
    threads: int = 2,
    rate: float | None = None,
    **settings: Any,
) -> NodeReconciler:
    return NodeReconciler(
        RegionRoot(str(root)),
        notifier or RecordingNotifier(),
        ReconcilerSettings(hosting=HostingSettings(threads, rate), **settings),
        holds=HoldChecker(proc_scan=proc_scan),
    )


def stop_agent(reconciler: NodeReconciler) -> None:
    """What the agent process's exit does: its mappings, mlocks and flocks go, the files stay."""
    reconciler.wait_idle(30)
    for hosted in reconciler.hosted_regions().values():
        hosted.release()


def settle(reconciler: NodeReconciler, cluster: ClusterView, passes: int = 50) -> PassResult:
    """Pass until nothing is in progress (opening threads joined between passes)."""
    result = reconciler.reconcile(cluster)
    for _ in range(passes):
        if result.settled:
            return result
        reconciler.wait_idle(10)
        result = reconciler.reconcile(cluster)
    raise AssertionError(f"not settled after {passes} passes: {result.reports}")


_HOLDER = """
import fcntl, mmap, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
if sys.argv[2] in ("flock", "exclusive"):
    fcntl.flock(fd, fcntl.LOCK_EX if sys.argv[2] == "exclusive" else fcntl.LOCK_SH)
m = mmap.mmap(fd, 0)
if sys.argv[2] == "map":
    os.close(fd)  # mapped only, as vLLM's own code leaves it after attaching
print("holding", flush=True)
time.sleep(60)
"""


@contextlib.contextmanager
def _holder(script: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """`script` in a process of its own, once it printed "holding"; killed on exit."""
    holder = subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        yield holder
    finally:
        holder.kill()
        holder.wait()


def holding(
    path: Path, how: str = "flock"
) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """Another process maps the file: with a shared flock like kvshm attachers ("flock"), with
    an exclusive one ("exclusive"), or mapped only, with no flock and no open descriptor
    ("map")."""
    return _holder(_HOLDER, str(path), how)


_LEASER = """
import fcntl, os, signal, sys, time
signal.signal(signal.SIGIO, signal.SIG_IGN)  # the kernel's notice that the lease is wanted
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH)  # attached, as a kvshm worker is, while the agent has it open
print("holding", flush=True)
while True:  # a read lease needs every writer gone (the agent lets go when it drains)
    try:
        if fcntl.fcntl(fd, fcntl.F_GETLEASE) == fcntl.F_UNLCK:
            fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
            fcntl.flock(fd, fcntl.LOCK_UN)  # from now on only the lease stands in the way
            print("leased", flush=True)
    except OSError:
        pass
    time.sleep(0.001)
"""


def leasing(path: Path) -> contextlib.AbstractContextManager[subprocess.Popen[str]]:
    """Another process holds the file with a shared flock, then, as soon as no one has it open
    for writing, with a read lease (F_SETLEASE) instead (it prints "leased"): any open for
    writing fails with EWOULDBLOCK until the kernel breaks the lease (lease-break-time, 45 s by
    default)."""
    return _holder(_LEASER, str(path))


def local_agent(regions: Path, root: Path, *extra: str) -> list[str]:
    """The command line of a local-mode agent (`python -m kvshm.agent.cli --local ...`)."""
    return [
        sys.executable,
        "-m",
        "kvshm.agent.cli",
        "--local",
        str(regions),
        "--root",
        str(root),
        "--poll-seconds",
        "0.2",
        *extra,
    ]
