"""Cluster mode against a real API server (tests/envtest) with the chart's agent
ServiceAccount: regions placed on this node become files, status goes into
status.nodes.<node> only, the OffloadNode keeps the inventory."""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path
from typing import Any

from kvshm.agent.reports import EventReason
from kvshm.api import ReclaimPolicy, parse_node_reports
from kvshm.operator.deletion import decide_release
from tests.agent.builders import MIB, holding, manifest, region_dir
from tests.agent.cluster import AgentCluster, agent_process, running_agent
from tests.envtest.fixtures import clean_up
from tests.envtest.server import EnvTest
from tests.operator.builders import cluster as snapshot
from tests.waiting import wait_for

NODE = "node-a"


def changed_nodes(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    """The status.nodes keys whose entries differ between two statuses."""
    old, new = before.get("nodes") or {}, after.get("nodes") or {}
    return {node for node in {*old, *new} if old.get(node) != new.get(node)}


def test_create_to_ready_with_progress_events_and_inventory(
    cluster: AgentCluster, shm_dir: Path
) -> None:
    cluster.add_node(NODE)
    namespace = cluster.namespace
    root = shm_dir / "root"
    # 256 MiB populated by one thread at 128 MiB/s: about two seconds of progress
    body = manifest("llm", namespace, blocks=256, page=MIB, workers=1, lock=False)
    with running_agent(
        cluster.kubeconfig, NODE, root, "--populate-threads", "1", "--populate-rate", "128Mi"
    ):
        created = cluster.create(body)
        history = cluster.status_history(
            created, lambda s: (s.get("nodes") or {}).get(NODE, {}).get("phase") == "Ready"
        )
        status = cluster.node_status("llm", NODE)
        path = root / namespace / "llm" / "vllm_offload_llm.mmap"
        assert status["path"] == str(path) and path.stat().st_size == 256 * MIB
        assert status["populatedBytes"] == status["sizeBytes"] == 256 * MIB
        assert status["populateSeconds"] > 1 and status["locked"] is False
        assert status["lastTransitionTime"]
        # progress was reported on the way (every stored status seen), about once a second
        progress = [
            s["nodes"][NODE]["populatedBytes"]
            for s in history
            if (s.get("nodes") or {}).get(NODE, {}).get("phase") == "Populating"
        ]
        assert any(0 < b < 256 * MIB for b in progress), progress
        assert len(progress) <= status["populateSeconds"] + 2
        # the agent wrote this node's key only
        assert all(set(s.get("nodes") or {}) <= {NODE} for s in history)
        reasons = [e["reason"] for e in cluster.all_events()]
        assert EventReason.CREATED.value in reasons and EventReason.READY.value in reasons
        # the agent holds the files of a region it hosts (a shared flock): held, never an orphan
        inventory = wait_for(
            lambda: cluster.node_status_of(NODE).get("files"), 10, "the file in the inventory"
        )
        assert inventory[0]["held"] is True and "orphanedSince" not in inventory[0]
        assert inventory[0]["path"] == f"{namespace}/llm/vllm_offload_llm.mmap"
        assert inventory[0]["claimedBy"] == f"{namespace}/llm"
        node = cluster.node_status_of(NODE)
        assert node["capacityBytes"] > 0 and node["agentVersion"] and node["heartbeat"]
    # stopping the agent released nothing
    assert path.stat().st_size == 256 * MIB
    assert cluster.phase_on("llm", NODE) == "Ready"
    assert os.stat(path).st_blocks * 512 >= 256 * MIB


def test_two_agents_report_into_their_own_keys(cluster: AgentCluster, shm_dir: Path) -> None:
    for node in ("node-a", "node-b"):
        cluster.add_node(node)
    created = cluster.create(manifest("shared", cluster.namespace))
    with (
        running_agent(cluster.kubeconfig, "node-a", shm_dir / "a"),
        running_agent(cluster.kubeconfig, "node-b", shm_dir / "b"),
    ):
        history = cluster.status_history(
            created,
            lambda s: all(
                (s.get("nodes") or {}).get(n, {}).get("phase") == "Ready"
                for n in ("node-a", "node-b")
            ),
        )
        nodes = cluster.status("shared")["nodes"]
        assert set(nodes) == {"node-a", "node-b"}
        assert nodes["node-a"]["path"].startswith(str(shm_dir / "a"))
        assert nodes["node-b"]["path"].startswith(str(shm_dir / "b"))
        # each stored write changed one node's entry: no agent rewrote the other's
        statuses = [created.get("status") or {}, *history]
        for before, after in itertools.pairwise(statuses):
            assert len(changed_nodes(before, after)) <= 1, (before, after)


def test_placement_by_names_and_labels_and_its_change(cluster: AgentCluster, shm_dir: Path) -> None:
    namespace = cluster.namespace
    cluster.add_node("node-a", {"gpu": "h100"})
    cluster.add_node("node-b", {"gpu": "a10"})
    cluster.create(manifest("h100-only", namespace, placement={"nodeSelector": {"gpu": "h100"}}))
    cluster.create(manifest("moves", namespace, placement={"nodeNames": ["node-a"]}))
    a_file = shm_dir / "a" / namespace / "moves" / "vllm_offload_moves.mmap"
    b_file = shm_dir / "b" / namespace / "moves" / "vllm_offload_moves.mmap"
    with (
        running_agent(cluster.kubeconfig, "node-a", shm_dir / "a"),
        running_agent(cluster.kubeconfig, "node-b", shm_dir / "b"),
    ):
        wait_for(lambda: cluster.phase_on("moves", "node-a") == "Ready", 30, "moves on a")
        wait_for(lambda: cluster.phase_on("h100-only", "node-a") == "Ready", 30, "label on a")
        assert cluster.phase_on("h100-only", "node-b") == ""  # never placed there: no key
        assert a_file.exists() and not b_file.exists()
        cluster.patch_region("moves", {"spec": {"placement": {"nodeNames": ["node-b"]}}})
        wait_for(lambda: cluster.phase_on("moves", "node-b") == "Ready", 30, "moves on b")
        wait_for(lambda: cluster.phase_on("moves", "node-a") == "Removed", 30, "off a")
        assert b_file.exists() and not a_file.exists()
        assert not (shm_dir / "a" / namespace / "moves").exists()


def test_delete_drains_waits_for_holders_and_removes(cluster: AgentCluster, shm_dir: Path) -> None:
    cluster.add_node(NODE)
    namespace = cluster.namespace
    body = manifest("gone", namespace)
    body["metadata"]["finalizers"] = ["kvshm.dev/operator"]  # what the operator adds
    cluster.create(body)
    path = shm_dir / "root" / namespace / "gone" / "vllm_offload_gone.mmap"
    with running_agent(cluster.kubeconfig, NODE, shm_dir / "root", "--drain-grace-seconds", "60"):
        wait_for(lambda: cluster.phase_on("gone", NODE) == "Ready", 30, "Ready")
        with holding(path):
            cluster.delete_region("gone")
            wait_for(lambda: cluster.phase_on("gone", NODE) == "Draining", 30, "Draining")
            status = cluster.node_status("gone", NODE)
            assert "waiting up to" in status["message"] and status["holders"] == 1
            assert path.exists()
        wait_for(lambda: cluster.phase_on("gone", NODE) == "Removed", 30, "Removed")
        assert not path.exists() and not (shm_dir / "root" / namespace).exists()
        reasons = [e["reason"] for e in cluster.all_events()]
        assert "Draining" in reasons and "Drained" in reasons


def test_a_restarted_agent_replaces_what_its_earlier_process_reported(
    cluster: AgentCluster, shm_dir: Path
) -> None:
    """Entries an earlier agent process left (Failed after a refused creation; Draining when it
    stopped after removing the files) for regions deleted or moved while no agent ran: the new
    process, which has none of their files, reports them Removed, so the deletion can finish."""
    cluster.add_node(NODE)
    namespace = cluster.namespace
    deleted = manifest("deleted", namespace)
    deleted["metadata"]["finalizers"] = ["kvshm.dev/operator"]  # what the operator adds
    cluster.create(deleted)
    cluster.create(manifest("moved", namespace, placement={"nodeNames": ["node-b"]}))
    cluster.create(manifest("never-here", namespace, placement={"nodeNames": ["node-b"]}))
    earlier = {"deleted": "Failed", "moved": "Draining"}
    for name, phase in earlier.items():
        entry = {"phase": phase, "message": "as the earlier process left it"}
        cluster.patch_region_status(name, {"status": {"nodes": {NODE: entry}}})
    cluster.delete_region("deleted")  # the finalizer keeps it, deletionTimestamp set
    with running_agent(cluster.kubeconfig, NODE, shm_dir / "root"):
        for name in earlier:
            wait_for(lambda n=name: cluster.phase_on(n, NODE) == "Removed", 30, f"{name} Removed")
            status = cluster.node_status(name, NODE)
            assert status["message"] == "nothing of the region is on this node", status
        # what the operator decides on: this node no longer holds the deleted region's files
        reports = parse_node_reports(cluster.status("deleted"))
        assert decide_release(ReclaimPolicy.DELETE, reports, snapshot([NODE])).release
        assert cluster.phase_on("never-here", NODE) == ""  # no entry: none is written


def test_restart_adopts_and_sigkill_mid_populate_loses_nothing(
    cluster: AgentCluster, shm_dir: Path
) -> None:
    cluster.add_node(NODE)
    namespace = cluster.namespace
    root = shm_dir / "root"
    cluster.create(manifest("big", namespace, blocks=256, page=MIB, workers=1))
    path = root / namespace / "big" / "vllm_offload_big.mmap"
    slow = ("--populate-threads", "1", "--populate-rate", "64Mi")  # 4 s for 256 MiB
    first = agent_process(cluster.kubeconfig, NODE, root, *slow)
    try:
        wait_for(lambda: cluster.phase_on("big", NODE) == "Populating", 30, "Populating")
        with open(path, "r+b") as f:  # an engine wrote a block meanwhile
            f.seek(4096)
            f.write(b"KVBLOCK!")
        inode = path.stat().st_ino
        first.kill()  # SIGKILL: no cleanup of any kind
        first.wait(10)
    finally:
        first.kill()
    assert path.stat().st_blocks * 512 < 256 * MIB  # it really was cut short
    second = agent_process(cluster.kubeconfig, NODE, root)
    try:
        wait_for(lambda: cluster.phase_on("big", NODE) == "Ready", 30, "Ready after restart")
        assert path.stat().st_ino == inode  # adopted, not re-created
        assert path.stat().st_blocks * 512 >= 256 * MIB  # and populated to the end
        with open(path, "rb") as f:
            f.seek(4096)
            assert f.read(8) == b"KVBLOCK!"  # never re-zeroed
        assert cluster.node_status("big", NODE)["locked"] is True
        second.terminate()  # SIGTERM: releases nothing
        assert second.wait(20) == 0
    finally:
        second.kill()
    assert path.stat().st_ino == inode
    reasons = [e["reason"] for e in cluster.all_events()]
    assert reasons.count("Created") == 1 and "Adopted" in reasons


def test_wrong_size_and_capacity_refusals_are_failed_statuses(
    cluster: AgentCluster, small_tmpfs: Path
) -> None:
    cluster.add_node(NODE)
    namespace = cluster.namespace
    root = small_tmpfs / "root"
    (region_dir(root, f"{namespace}/odd") / "vllm_offload_odd.mmap").write_bytes(b"x" * 4096)
    cluster.create(manifest("odd", namespace))
    cluster.create(manifest("huge", namespace, blocks=100, page=MIB, workers=1))
    with running_agent(cluster.kubeconfig, NODE, root, "--reserve-bytes", "8Mi"):
        wait_for(lambda: cluster.phase_on("odd", NODE) == "Failed", 30, "odd Failed")
        wait_for(lambda: cluster.phase_on("huge", NODE) == "Failed", 30, "huge Failed")
        odd_message = cluster.node_status("odd", NODE)["message"]
        assert "is 4096 bytes but the layout needs 2097152 bytes" in odd_message
        huge_message = cluster.node_status("huge", NODE)["message"]
        assert "not enough room" in huge_message and "8.0 MiB reserved" in huge_message
        warnings = [e for e in cluster.all_events() if e["type"] == "Warning"]
        assert {e["involvedObject"]["name"] for e in warnings} == {"odd", "huge"}
    assert (root / namespace / "odd" / "vllm_offload_odd.mmap").read_bytes() == b"x" * 4096
    assert not (root / namespace / "huge" / "vllm_offload_huge.mmap").exists()


def test_reclaims_from_the_offload_node_spec_are_rechecked_and_reported(
    cluster: AgentCluster, shm_dir: Path
) -> None:
    cluster.add_node(NODE)
    namespace = cluster.namespace
    root = shm_dir / "root"
    for name in ("orphan", "claimed"):
        directory = region_dir(root, f"{namespace}/{name}")
        (directory / f"vllm_offload_{name}.mmap").write_bytes(b"\0" * 2097152)
    cluster.create(manifest("claimed", namespace))
    orphan_path = f"{namespace}/orphan/vllm_offload_orphan.mmap"
    claimed_path = f"{namespace}/claimed/vllm_offload_claimed.mmap"
    with running_agent(cluster.kubeconfig, NODE, root):
        wait_for(lambda: cluster.phase_on("claimed", NODE) == "Ready", 30, "Ready")
        files = wait_for(
            lambda: {
                f["path"]: f
                for f in cluster.node_status_of(NODE).get("files") or []
                if f["path"] == orphan_path
            },
            10,
            "the orphan in the inventory",
        )
        orphan = files[orphan_path]
        assert orphan["claimedBy"] == "" and orphan["orphanedSince"]
        requests = [
            {
                "path": path,
                "sizeBytes": 2097152,
                "requestedAt": "2026-01-01T00:00:00Z",
                "reason": "orphaned for longer than the grace period",
            }
            for path in (orphan_path, claimed_path)
        ]
        cluster.patch_offload_node_spec(NODE, {"reclaims": requests})

        def results() -> dict[str, dict[str, str]]:
            return {r["path"]: r for r in cluster.node_status_of(NODE).get("reclaims") or []}

        done = wait_for(lambda: len(results()) == 2 and results(), 20, "two reclaim results")
        assert done[orphan_path]["outcome"] == "Done"
        assert done[claimed_path]["outcome"] == "RefusedClaimed"
        assert not (root / namespace / "orphan").exists()
        assert (root / claimed_path).exists()
        node_events = [e["reason"] for e in cluster.all_events("default")]
        assert "Reclaimed" in node_events and "ReclaimRefused" in node_events


def _plant_hostile_entries(root: Path, outside: Path, team: str, evil: str) -> dict[str, str]:
    """One region per planted hazard (under namespace `team`, or `evil` for a namespace that is
    a symlink itself); returns region name -> what its Failed message must say."""

    def region_file(name: str) -> Path:
        return region_dir(root, f"{team}/{name}") / f"vllm_offload_{name}.mmap"

    region_file("file-symlink").symlink_to(outside / "secret")
    os.mkfifo(region_file("fifo"))
    os.link(outside / "sized", region_file("hardlink"))
    region_file("directory").mkdir()
    (root / team / "dir-symlink").symlink_to(outside)
    (root / team / "dir-file").write_bytes(b"")
    (root / evil).symlink_to(outside)  # a whole namespace
    return {
        "file-symlink": "symbolic link",
        "fifo": "FIFO",
        "hardlink": "2 hard links",
        "directory": "a directory",
        "dir-symlink": "symbolic link",
        "dir-file": "a regular file",
        "ns-symlink": "symbolic link",
    }


def test_every_hostile_entry_fails_its_region_and_nothing_outside_changes(
    cluster: AgentCluster, shm_dir: Path
) -> None:
    cluster.add_node(NODE)
    team, evil = cluster.namespace, f"{cluster.namespace}-evil"
    cluster.core.create_namespace({"metadata": {"name": evil}})
    root = shm_dir / "root"
    outside = shm_dir / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"keep")
    (outside / "sized").write_bytes(b"\0" * 2097152)  # the right size for the hard link
    before = {
        p.name: (p.lstat().st_mode, p.lstat().st_uid, p.lstat().st_size) for p in outside.iterdir()
    }
    expected = _plant_hostile_entries(root, outside, team, evil)
    owner = {"uid": 777, "gid": 777, "mode": 0o600}
    where = {name: (evil, "r") if name == "ns-symlink" else (team, name) for name in expected}
    try:
        for namespace, name in where.values():
            cluster.create(manifest(name, namespace, access=owner))
        with running_agent(cluster.kubeconfig, NODE, root):
            for case, (namespace, name) in where.items():
                wait_for(
                    lambda n=name, ns=namespace: cluster.phase_on(n, NODE, ns) == "Failed", 30, case
                )
                message = cluster.node_status(name, NODE, namespace)["message"]
                assert expected[case] in message, (case, message)
            condition = wait_for(
                lambda: [
                    c
                    for c in cluster.node_status_of(NODE).get("conditions") or []
                    if c["type"] == "RootSafe" and c["status"] == "False"
                ],
                10,
                "RootSafe False",
            )[0]
            assert "symbolic link" in condition["message"] and "FIFO" in condition["message"]
    finally:
        clean_up(cluster.client, evil)
    after = {
        p.name: (p.lstat().st_mode, p.lstat().st_uid, p.lstat().st_size) for p in outside.iterdir()
    }
    assert after == before
    assert (outside / "secret").read_bytes() == b"keep"


def test_an_api_server_restart_restarts_the_watch_and_changes_still_arrive(
    cluster: AgentCluster, envtest: EnvTest, shm_dir: Path
) -> None:
    """The watch ends under the agent (the server goes away) and its resume version may be
    gone from the new server's watch cache: the agent watches again and misses nothing."""
    cluster.add_node(NODE)
    with running_agent(cluster.kubeconfig, NODE, shm_dir / "root") as app:
        cluster.create(manifest("one", cluster.namespace))
        wait_for(lambda: cluster.phase_on("one", NODE) == "Ready", 30, "one Ready")
        envtest.stop_apiserver()
        envtest.start_apiserver()
        cluster.create(manifest("two", cluster.namespace))
        wait_for(lambda: cluster.phase_on("two", NODE) == "Ready", 60, "two Ready")
        restarts = app.metrics.registry.get_sample_value("kvshm_agent_watch_restarts_total")
        assert restarts is not None and restarts >= 1


def test_other_agents_status_patches_do_not_wake_this_agent(
    cluster: AgentCluster, shm_dir: Path
) -> None:
    cluster.add_node(NODE)
    cluster.create(manifest("quiet", cluster.namespace))
    with running_agent(cluster.kubeconfig, NODE, shm_dir / "root", "--resync-seconds", "30") as app:
        wait_for(lambda: cluster.phase_on("quiet", NODE) == "Ready", 30, "Ready")
        time.sleep(1.5)  # the passes that follow Ready (and our own patches' echoes) are over
        passes = []
        real = app.reconciler.reconcile
        app.reconciler.reconcile = lambda view: passes.append(1) or real(view)  # type: ignore[method-assign]
        for i in range(20):  # another node's agent reporting progress
            other = {"phase": "Populating", "populatedBytes": i}
            cluster.patch_region_status("quiet", {"status": {"nodes": {"node-z": other}}})
        time.sleep(1.0)
        assert len(passes) <= 1, f"{len(passes)} passes for 20 foreign status patches"
        cluster.patch_region("quiet", {"spec": {"lock": False}})  # a spec change does
        wait_for(lambda: cluster.node_status("quiet", NODE).get("locked") is False, 10, "unlock")
        assert len(passes) >= 1


def test_a_deleted_offload_node_is_made_again(cluster: AgentCluster, shm_dir: Path) -> None:
    cluster.add_node(NODE)
    with running_agent(cluster.kubeconfig, NODE, shm_dir / "root"):
        first = wait_for(lambda: cluster.offload_node(NODE), 10, "the OffloadNode")
        wait_for(lambda: cluster.node_status_of(NODE).get("heartbeat"), 10, "a heartbeat")
        cluster.delete_offload_node(NODE)
        again = wait_for(
            lambda: cluster.node_status_of(NODE).get("heartbeat") and cluster.offload_node(NODE),
            15,
            "a new OffloadNode with a heartbeat",
        )
        assert again["metadata"]["uid"] != first["metadata"]["uid"]
