"""Simulated agents for the operator benchmark: many nodes, no files, the agents' API protocol.

Each simulated node has an OffloadNode with a heartbeat and an inventory, reports every region
placed on it through status.nodes.<node> (Creating, then Ready), reports Removed when a region
is deleted, and answers the reclaims the operator writes into its spec. One watch per resource
serves every node, so the API server, not the simulation, is what a large fleet costs.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import kubernetes

from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION, InventoryFile, RegionAddress

CAPACITY = 2**40


def now_text() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def watch(
    lister: Any,
    args: tuple[str, ...],
    handle: Any,
    stop: threading.Event,
    errors: queue.Queue[str],
) -> None:
    """List, then watch from there (listing again after a 410) until `stop`: handle(obj,
    deleted=...) for every object and change; errors are put on `errors`."""
    version = ""
    while not stop.is_set():
        try:
            if not version:
                listing = lister(*args)
                version = listing["metadata"]["resourceVersion"]
                for obj in listing["items"]:
                    handle(obj, deleted=False)
            stream = kubernetes.watch.Watch().stream(
                lister, *args, resource_version=version, timeout_seconds=60
            )
            for event in stream:
                obj = event["object"]
                version = obj["metadata"]["resourceVersion"]
                handle(obj, deleted=event["type"] == "DELETED")
                if stop.is_set():
                    return
        except kubernetes.client.ApiException as exc:
            if exc.status == 410:
                version = ""
            else:
                errors.put(f"watch {args[-1]}: {exc.status} {exc.reason}")
                time.sleep(0.5)
        except Exception as exc:  # a dropped stream: start over from the last version
            if stop.is_set():
                return
            errors.put(f"watch {args[-1]}: {exc!r}")
            time.sleep(0.2)


@dataclass
class SimNode:
    name: str
    files: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> inventory entry
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # path -> reclaim result
    dirty: bool = True
    silent: bool = False


class Fleet:
    def __init__(
        self,
        configuration: kubernetes.client.Configuration,
        nodes: Iterable[str],
        *,
        workers: int = 8,
        heartbeat_seconds: float = 10.0,
    ) -> None:
        configuration.connection_pool_maxsize = workers + 4
        self._client = kubernetes.client.ApiClient(configuration)
        self.core = kubernetes.client.CoreV1Api(self._client)
        self.custom = kubernetes.client.CustomObjectsApi(self._client)
        self.nodes = {name: SimNode(name) for name in nodes}
        self._heartbeat_seconds = heartbeat_seconds
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="sim-agent")
        self._lock = threading.Lock()
        self._reported: dict[tuple[str, str], str] = {}  # (region key, node) -> phase sent
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.reclaimed_at: dict[str, float] = {}  # path -> monotonic time the file went
        self.errors: queue.Queue[str] = queue.Queue()

    # -- set-up ------------------------------------------------------------------------------
    def register(self, admin: kubernetes.client.CoreV1Api) -> None:
        """Each node's Node (by `admin`: an agent may not create one) and OffloadNode."""
        for node in self.nodes.values():
            admin.create_node({"metadata": {"name": node.name}})  # type: ignore[arg-type]
            self.custom.create_cluster_custom_object(
                GROUP,
                VERSION,
                NODE_PLURAL,
                {
                    "apiVersion": f"{GROUP}/{VERSION}",
                    "kind": "OffloadNode",
                    "metadata": {"name": node.name},
                    "spec": {},
                },
            )
            self._publish_node(node)

    def start(self) -> None:
        for target in (self._watch_regions, self._watch_nodes, self._heartbeats):
            thread = threading.Thread(target=target, daemon=True, name=target.__name__)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- what tests and the benchmark steer ---------------------------------------------------
    def add_orphan(self, node: str, path: str, size: int, held: bool = False) -> None:
        """A file no region claims, published as the agent does: unheld, with the second it
        was first seen an orphan (rounded up), from which the operator's grace period runs."""
        seen = None if held else datetime.now(UTC) + timedelta(microseconds=999_999)
        entry = InventoryFile(path, size, "", held, orphaned_since=seen).to_status()
        with self._lock:
            self.nodes[node].files[path] = entry
            self.nodes[node].dirty = True

    # -- regions -------------------------------------------------------------------------------
    def _watch_regions(self) -> None:
        self._watch(
            self.custom.list_cluster_custom_object, (GROUP, VERSION, REGION_PLURAL), self._on_region
        )

    def _watch_nodes(self) -> None:
        self._watch(
            self.custom.list_cluster_custom_object, (GROUP, VERSION, NODE_PLURAL), self._on_node
        )

    def _watch(self, lister: Any, args: tuple[str, ...], handle: Any) -> None:
        watch(lister, args, handle, self._stop, self.errors)

    def _on_region(self, obj: dict[str, Any], deleted: bool) -> None:
        if deleted:
            return
        meta, spec = obj["metadata"], obj.get("spec") or {}
        key = f"{meta['namespace']}/{meta['name']}"
        placed = ((spec.get("placement") or {}).get("nodeNames")) or list(self.nodes)
        deleting = bool(meta.get("deletionTimestamp"))
        for node in placed:
            if node not in self.nodes or self.nodes[node].silent:
                continue
            with self._lock:
                sent = self._reported.get((key, node))
                wanted = "Removed" if deleting else "Ready"
                if sent in (wanted, "pending-" + wanted) or (deleting and sent is None):
                    continue
                self._reported[(key, node)] = "pending-" + wanted
            self._pool.submit(self._report, obj, node, wanted)

    def _report(self, obj: dict[str, Any], node: str, wanted: str) -> None:
        meta, spec = obj["metadata"], obj.get("spec") or {}
        address = RegionAddress(
            meta["namespace"], meta["name"], spec.get("instanceId") or meta["name"]
        )
        key = address.key
        layout = spec["layout"]
        size = layout["numBlocks"] * layout["cpuPageSize"] * layout.get("numWorkers", 1)
        path = address.file_0_path
        try:
            if wanted == "Ready":
                self._patch_region(meta, node, {"phase": "Creating", "path": path})
                with self._lock:
                    self.nodes[node].files[path] = InventoryFile(path, size, key, False).to_status()
                    self.nodes[node].dirty = True
                self._patch_region(
                    meta,
                    node,
                    {
                        "phase": "Ready",
                        "path": path,
                        "populatedBytes": size,
                        "locked": True,
                        "observedGeneration": meta.get("generation", 1),
                    },
                )
            else:
                with self._lock:
                    self.nodes[node].files.pop(path, None)
                    self.nodes[node].dirty = True
                self._patch_region(meta, node, {"phase": "Removed", "path": path})
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                self.errors.put(f"report {key} on {node}: {exc.status} {exc.reason}")
                with self._lock:
                    self._reported.pop((key, node), None)
            return
        with self._lock:
            self._reported[(key, node)] = wanted

    def _patch_region(self, meta: dict[str, Any], node: str, entry: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            meta["namespace"],
            REGION_PLURAL,
            meta["name"],
            {"status": {"nodes": {node: entry}}},
        )

    # -- OffloadNodes --------------------------------------------------------------------------
    def _on_node(self, obj: dict[str, Any], deleted: bool) -> None:
        node = self.nodes.get(obj["metadata"]["name"])
        if node is None or deleted or node.silent:
            return
        requests = {e["path"]: e for e in (obj.get("spec") or {}).get("reclaims") or ()}
        changed = False
        with self._lock:
            for path in list(node.results):
                if path not in requests:  # the operator closed it
                    del node.results[path]
                    changed = True
            for path in requests:
                if path in node.results:
                    continue
                entry = node.files.get(path)
                if entry is not None and (entry["held"] or entry["claimedBy"]):
                    outcome = "RefusedHeld" if entry["held"] else "RefusedClaimed"
                else:
                    outcome = "Done"
                    node.files.pop(path, None)
                    self.reclaimed_at.setdefault(path, time.monotonic())
                node.results[path] = {"path": path, "outcome": outcome, "time": now_text()}
                changed = True
            node.dirty = node.dirty or changed
        if changed:
            self._pool.submit(self._publish_node, node)

    def _heartbeats(self) -> None:
        last = dict.fromkeys(self.nodes, 0.0)
        while not self._stop.wait(0.5):
            for node in self.nodes.values():
                due = time.monotonic() - last[node.name] >= self._heartbeat_seconds
                if not node.silent and (node.dirty or due):
                    last[node.name] = time.monotonic()
                    self._pool.submit(self._publish_node, node)

    def _publish_node(self, node: SimNode) -> None:
        with self._lock:
            node.dirty = False
            status = {
                "heartbeat": now_text(),
                "capacityBytes": CAPACITY,
                "freeBytes": CAPACITY - sum(f["sizeBytes"] for f in node.files.values()),
                "agentVersion": "simulated",
                "files": sorted(node.files.values(), key=lambda f: f["path"]),
                "reclaims": sorted(node.results.values(), key=lambda r: r["path"]),
            }
        try:
            self.custom.patch_cluster_custom_object_status(
                GROUP, VERSION, NODE_PLURAL, node.name, {"status": status}
            )
        except kubernetes.client.ApiException as exc:
            self.errors.put(f"publish {node.name}: {exc.status} {exc.reason}")
