"""The OffloadNode spec lists the operator writes, against a real API server (tests/envtest) that
enforces the CRD's bounds: the operator stays inside them, and a write the server refuses never
stops a node's sweeps nor holds a region's finalizer.

The OffloadNodes here are written by the test as their agents would (no agent process: the
inventories are larger than a test's tmpfs should hold); the operator is the real process.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from kvshm.api import GROUP, NODE_PLURAL, REGION_PLURAL, VERSION
from kvshm.api.reading import MAX_RECLAIMS, MAX_RETAINED, format_timestamp
from kvshm.operator.kopf_settings import FINALIZER
from tests.envtest import manifests
from tests.operator.harness import TEST_CONFIG, Cluster, OperatorProcess, operator_process
from tests.waiting import wait_for

# every orphan is due at once: the agents' orphanedSince is long past the grace period
CONFIG = dataclasses.replace(TEST_CONFIG, orphan_grace_seconds=1.0, agent_silence_seconds=60.0)
LONG_AGO = "2020-01-01T00:00:00Z"


def orphan(path: str) -> dict[str, Any]:
    return {
        "path": path,
        "sizeBytes": 4096,
        "fileCount": 1,
        "claimedBy": "",
        "held": False,
        "ageSeconds": 9999,
        "orphanedSince": LONG_AGO,
    }


def orphan_path(index: int) -> str:
    return f"team/o{index}/vllm_offload_o{index}.mmap"


def write_offload_node(
    cluster: Cluster, name: str, files: list[str], spec: dict[str, Any] | None = None
) -> None:
    """An OffloadNode as its agent registers it: a heartbeat of now and this inventory."""
    cluster.custom.create_cluster_custom_object(
        GROUP, VERSION, NODE_PLURAL, manifests.offload_node(name, spec or {})
    )
    report_status(cluster, name, files=[orphan(path) for path in files])


def report_status(cluster: Cluster, name: str, **status: Any) -> None:
    heartbeat = format_timestamp(datetime.now(UTC))
    body = {"heartbeat": heartbeat, "capacityBytes": 2**40, "freeBytes": 2**40, **status}
    cluster.custom.patch_cluster_custom_object_status(
        GROUP, VERSION, NODE_PLURAL, name, {"status": body}
    )


def spec_list(cluster: Cluster, node: str, key: str) -> list[dict[str, Any]]:
    return list(((cluster.offload_node(node) or {}).get("spec") or {}).get(key) or ())


@pytest.fixture
def operator(
    api_cluster: Cluster, operator_kubeconfig: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[OperatorProcess]:
    yield from operator_process(operator_kubeconfig, tmp_path, request, CONFIG)


def test_more_due_orphans_than_spec_reclaims_holds_are_requested_in_turns(
    api_cluster: Cluster, operator: OperatorProcess
) -> None:
    paths = [orphan_path(i) for i in range(MAX_RECLAIMS + 1)]
    write_offload_node(api_cluster, "node-a", paths)
    first = wait_for(
        lambda: spec_list(api_cluster, "node-a", "reclaims"),
        60,
        "the first reclaims to be requested",
    )
    assert len(first) == MAX_RECLAIMS  # as many as the CRD allows, the rest wait
    requested = {entry["path"] for entry in first}
    (waiting,) = set(paths) - requested
    # the agent answers every request and removes the files
    now = format_timestamp(datetime.now(UTC))
    report_status(
        api_cluster,
        "node-a",
        files=[orphan(waiting)],
        reclaims=[
            {"path": path, "outcome": "Done", "message": "removed", "time": now}
            for path in sorted(requested)
        ],
    )
    wait_for(
        lambda: [e["path"] for e in spec_list(api_cluster, "node-a", "reclaims")] == [waiting],
        60,
        "the answered requests to be closed and the waiting orphan requested",
    )


def test_a_sweep_the_server_refuses_does_not_stop_that_nodes_sweeps(
    api_cluster: Cluster, operator: OperatorProcess
) -> None:
    # An inventory path the CRD refuses in spec.reclaims (a '..' segment): every write of the
    # reclaim list for this node fails with 422 Invalid.
    write_offload_node(api_cluster, "node-b", ["team/../x/vllm_offload_x.mmap"])
    wait_for(lambda: "[node-b] Timer 'sweep'" in operator.output(), 60, "node-b's first sweep")
    time.sleep(5 * CONFIG.node_sweep_seconds)  # a few more, each refused
    # the node goes; its agent is silent: a later sweep must still remove its OffloadNode
    api_cluster.delete_node("node-b")
    api_cluster.custom.patch_cluster_custom_object_status(
        GROUP, VERSION, NODE_PLURAL, "node-b", {"status": {"heartbeat": LONG_AGO}}
    )
    wait_for(
        lambda: api_cluster.offload_node("node-b") is None,
        60,
        "the gone node's OffloadNode to be removed by a later sweep",
    )
    assert "a reclaim path must not contain a '..' segment" in operator.output()


def test_a_retain_deletion_is_released_when_spec_retained_is_full(
    api_cluster: Cluster, operator: OperatorProcess
) -> None:
    full = [{"path": f"k/r{i}/vllm_offload_{i}.mmap"} for i in range(MAX_RETAINED)]
    write_offload_node(api_cluster, "node-a", [], {"retained": full})
    api_cluster.create_region("kept", reclaimPolicy="Retain", placement={"nodeNames": ["node-a"]})
    wait_for(
        lambda: (
            FINALIZER
            in ((api_cluster.region("kept") or {}).get("metadata") or {}).get("finalizers", ())
        ),
        60,
        "the operator's finalizer on the region",
    )
    # node-a's agent made the region's file (as its report says)
    api_cluster.custom.patch_namespaced_custom_object_status(
        GROUP,
        VERSION,
        api_cluster.namespace,
        REGION_PLURAL,
        "kept",
        {"status": {"nodes": {"node-a": {"phase": "Ready", "observedGeneration": 1}}}},
    )
    api_cluster.delete_region("kept")
    api_cluster.wait_gone("kept", timeout=60)
    events = api_cluster.wait_events("kept", "RetainNotRecorded")
    warnings = [e for e in events if e["reason"] == "RetainNotRecorded"]
    assert "node-a" in warnings[0]["message"] and "spec.retained" in warnings[0]["message"]
    assert len(spec_list(api_cluster, "node-a", "retained")) == MAX_RETAINED
