"""Cluster mode against the Kubernetes API emulator: regions placed on this node become files,
status goes into status.nodes.<node> only, the OffloadNode keeps the inventory."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kvshm.agent.reports import EventReason
from tests.agent.builders import MIB, holding, manifest, region_dir
from tests.agent.cluster import (
    agent_process,
    create_region,
    delete_region,
    events,
    get_region,
    node_status,
    offload_node,
    patch_offload_node_spec,
    patch_region,
    phase_of,
    region_patches,
    running_agent,
    setup_cluster,
)
from tests.kube.runner import KubeApi
from tests.waiting import wait_for

NODE = "node-a"


def test_create_to_ready_with_progress_events_and_inventory(
    kube_api: KubeApi, kubeconfig: Path, shm_dir: Path
) -> None:
    setup_cluster(kube_api, "team", nodes={NODE: {}})
    root = shm_dir / "root"
    # 256 MiB populated by one thread at 128 MiB/s: about two seconds of progress
    body = manifest("llm", "team", blocks=256, page=MIB, workers=1, lock=False)
    with running_agent(
        kubeconfig, NODE, root, "--populate-threads", "1", "--populate-rate", "128Mi"
    ):
        region = create_region(kube_api, body)
        wait_for(lambda: phase_of(kube_api, region, NODE) == "Ready", 30, "Ready")
        status = node_status(kube_api, region, NODE)
        path = root / "team" / "llm" / "vllm_offload_llm.mmap"
        assert status["path"] == str(path) and path.stat().st_size == 256 * MIB
        assert status["populatedBytes"] == status["sizeBytes"] == 256 * MIB
        assert status["populateSeconds"] > 1 and status["locked"] is False
        assert status["lastTransitionTime"]
        # progress was reported on the way, at most about once a second
        progress = [
            p["status"]["nodes"][NODE]["populatedBytes"]
            for p in region_patches(kube_api, "llm")
            if p["status"]["nodes"][NODE]["phase"] == "Populating"
        ]
        assert any(0 < b < 256 * MIB for b in progress), progress
        assert len(progress) <= status["populateSeconds"] + 2
        # every patch carried this node's key only
        assert all(list(p["status"]["nodes"]) == [NODE] for p in region_patches(kube_api, "llm"))
        reasons = [e["reason"] for e in events(kube_api, "team")]
        assert EventReason.CREATED.value in reasons and EventReason.READY.value in reasons
        # while populating, the agent's own populate holds the file; once Ready nothing does
        inventory = wait_for(
            lambda: [
                f
                for f in (offload_node(kube_api, NODE).get("status") or {}).get("files") or []
                if f["held"] is False
            ],
            10,
            "the file, not held, in the inventory",
        )
        assert inventory[0]["path"] == "team/llm/vllm_offload_llm.mmap"
        assert inventory[0]["claimedBy"] == "team/llm"
        node = offload_node(kube_api, NODE)["status"]
        assert node["capacityBytes"] > 0 and node["agentVersion"] and node["heartbeat"]
    # stopping the agent released nothing
    assert path.stat().st_size == 256 * MIB
    assert get_region(kube_api, "team", "llm")["status"]["nodes"][NODE]["phase"] == "Ready"
    assert os.stat(path).st_blocks * 512 >= 256 * MIB


def test_two_agents_report_into_their_own_keys(
    kube_api: KubeApi, kubeconfig: Path, shm_dir: Path
) -> None:
    setup_cluster(kube_api, "team", nodes={"node-a": {}, "node-b": {}})
    region = create_region(kube_api, manifest("shared", "team"))
    with (
        running_agent(kubeconfig, "node-a", shm_dir / "a"),
        running_agent(kubeconfig, "node-b", shm_dir / "b"),
    ):
        wait_for(
            lambda: (
                phase_of(kube_api, region, "node-a") == "Ready"
                and phase_of(kube_api, region, "node-b") == "Ready"
            ),
            30,
            "both nodes Ready",
        )
        nodes = get_region(kube_api, "team", "shared")["status"]["nodes"]
        assert set(nodes) == {"node-a", "node-b"}
        assert nodes["node-a"]["path"].startswith(str(shm_dir / "a"))
        assert nodes["node-b"]["path"].startswith(str(shm_dir / "b"))
        for patch in region_patches(kube_api, "shared"):
            assert len(patch["status"]["nodes"]) == 1  # a node's own key, nothing else


def test_placement_by_names_and_labels_and_its_change(
    kube_api: KubeApi, kubeconfig: Path, shm_dir: Path
) -> None:
    setup_cluster(kube_api, "team", nodes={"node-a": {"gpu": "h100"}, "node-b": {"gpu": "a10"}})
    by_label = create_region(
        kube_api, manifest("h100-only", "team", placement={"nodeSelector": {"gpu": "h100"}})
    )
    by_name = create_region(
        kube_api, manifest("moves", "team", placement={"nodeNames": ["node-a"]})
    )
    a_file = shm_dir / "a" / "team" / "moves" / "vllm_offload_moves.mmap"
    b_file = shm_dir / "b" / "team" / "moves" / "vllm_offload_moves.mmap"
    with (
        running_agent(kubeconfig, "node-a", shm_dir / "a"),
        running_agent(kubeconfig, "node-b", shm_dir / "b"),
    ):
        wait_for(lambda: phase_of(kube_api, by_name, "node-a") == "Ready", 30, "moves on a")
        wait_for(lambda: phase_of(kube_api, by_label, "node-a") == "Ready", 30, "label on a")
        assert phase_of(kube_api, by_label, "node-b") == ""  # never placed there: no key
        assert a_file.exists() and not b_file.exists()
        patch_region(kube_api, "team", "moves", {"spec": {"placement": {"nodeNames": ["node-b"]}}})
        wait_for(lambda: phase_of(kube_api, by_name, "node-b") == "Ready", 30, "moves on b")
        wait_for(lambda: phase_of(kube_api, by_name, "node-a") == "Removed", 30, "off a")
        assert b_file.exists() and not a_file.exists()
        assert not (shm_dir / "a" / "team" / "moves").exists()


def test_delete_drains_waits_for_holders_and_removes(
    kube_api: KubeApi, kubeconfig: Path, shm_dir: Path
) -> None:
    setup_cluster(kube_api, "team", nodes={NODE: {}})
    body = manifest("gone", "team")
    body["metadata"]["finalizers"] = ["kvshm.dev/operator"]  # what the operator adds
    region = create_region(kube_api, body)
    path = shm_dir / "root" / "team" / "gone" / "vllm_offload_gone.mmap"
    with running_agent(kubeconfig, NODE, shm_dir / "root", "--drain-grace-seconds", "60"):
        wait_for(lambda: phase_of(kube_api, region, NODE) == "Ready", 30, "Ready")
        with holding(path):
            delete_region(kube_api, "team", "gone")
            wait_for(lambda: phase_of(kube_api, region, NODE) == "Draining", 30, "Draining")
            status = node_status(kube_api, region, NODE)
            assert "waiting up to" in status["message"] and status["holders"] == 1
            assert path.exists()
        wait_for(lambda: phase_of(kube_api, region, NODE) == "Removed", 30, "Removed")
        assert not path.exists() and not (shm_dir / "root" / "team").exists()
        reasons = [e["reason"] for e in events(kube_api, "team")]
        assert "Draining" in reasons and "Drained" in reasons


def test_restart_adopts_and_sigkill_mid_populate_loses_nothing(
    kube_api: KubeApi, kubeconfig: Path, shm_dir: Path
) -> None:
    setup_cluster(kube_api, "team", nodes={NODE: {}})
    root = shm_dir / "root"
    region = create_region(kube_api, manifest("big", "team", blocks=256, page=MIB, workers=1))
    path = root / "team" / "big" / "vllm_offload_big.mmap"
    slow = ("--populate-threads", "1", "--populate-rate", "64Mi")  # 4 s for 256 MiB
    first = agent_process(kubeconfig, NODE, root, *slow)
    try:
        wait_for(lambda: phase_of(kube_api, region, NODE) == "Populating", 30, "Populating")
        with open(path, "r+b") as f:  # an engine wrote a block meanwhile
            f.seek(4096)
            f.write(b"KVBLOCK!")
        inode = path.stat().st_ino
        first.kill()  # SIGKILL: no cleanup of any kind
        first.wait(10)
    finally:
        first.kill()
    assert path.stat().st_blocks * 512 < 256 * MIB  # it really was cut short
    second = agent_process(kubeconfig, NODE, root)
    try:
        wait_for(lambda: phase_of(kube_api, region, NODE) == "Ready", 30, "Ready after restart")
        assert path.stat().st_ino == inode  # adopted, not re-created
        assert path.stat().st_blocks * 512 >= 256 * MIB  # and populated to the end
        with open(path, "rb") as f:
            f.seek(4096)
            assert f.read(8) == b"KVBLOCK!"  # never re-zeroed
        assert node_status(kube_api, region, NODE)["locked"] is True
        second.terminate()  # SIGTERM: releases nothing
        assert second.wait(20) == 0
    finally:
        second.kill()
    assert path.stat().st_ino == inode
    reasons = [e["reason"] for e in events(kube_api, "team")]
    assert reasons.count("Created") == 1 and "Adopted" in reasons


def test_wrong_size_and_capacity_refusals_are_failed_statuses(
    kube_api: KubeApi, kubeconfig: Path, small_tmpfs: Path
) -> None:
    setup_cluster(kube_api, "team", nodes={NODE: {}})
    root = small_tmpfs / "root"
    (region_dir(root, "team/odd") / "vllm_offload_odd.mmap").write_bytes(b"x" * 4096)
    odd = create_region(kube_api, manifest("odd", "team"))
    huge = create_region(kube_api, manifest("huge", "team", blocks=100, page=MIB, workers=1))
    with running_agent(kubeconfig, NODE, root, "--reserve-bytes", "8Mi"):
        wait_for(lambda: phase_of(kube_api, odd, NODE) == "Failed", 30, "odd Failed")
        wait_for(lambda: phase_of(kube_api, huge, NODE) == "Failed", 30, "huge Failed")
        odd_message = node_status(kube_api, odd, NODE)["message"]
        assert "is 4096 bytes but the layout needs 2097152 bytes" in odd_message
        huge_message = node_status(kube_api, huge, NODE)["message"]
        assert "not enough room" in huge_message and "8.0 MiB reserved" in huge_message
        warnings = [e for e in events(kube_api, "team") if e["type"] == "Warning"]
        assert {e["involvedObject"]["name"] for e in warnings} == {"odd", "huge"}
    assert (root / "team" / "odd" / "vllm_offload_odd.mmap").read_bytes() == b"x" * 4096
    assert not (root / "team" / "huge" / "vllm_offload_huge.mmap").exists()


def test_reclaims_from_the_offload_node_spec_are_rechecked_and_reported(
    kube_api: KubeApi, kubeconfig: Path, shm_dir: Path
) -> None:
    setup_cluster(kube_api, "team", nodes={NODE: {}})
    root = shm_dir / "root"
    for name in ("orphan", "claimed"):
        directory = region_dir(root, f"team/{name}")
        (directory / f"vllm_offload_{name}.mmap").write_bytes(b"\0" * 2097152)
    claimed = create_region(kube_api, manifest("claimed", "team"))
    with running_agent(kubeconfig, NODE, root):
        wait_for(lambda: phase_of(kube_api, claimed, NODE) == "Ready", 30, "Ready")
        files = wait_for(
            lambda: {
                f["path"]: f
                for f in (offload_node(kube_api, NODE).get("status") or {}).get("files") or []
                if f["path"].startswith("team/orphan")
            },
            10,
            "the orphan in the inventory",
        )
        orphan = files["team/orphan/vllm_offload_orphan.mmap"]
        assert orphan["claimedBy"] == "" and orphan["firstSeenUnclaimed"]
        requests = [
            {
                "path": path,
                "sizeBytes": 2097152,
                "requestedAt": "2026-01-01T00:00:00Z",
                "reason": "orphaned for longer than the grace period",
            }
            for path in (
                "team/orphan/vllm_offload_orphan.mmap",
                "team/claimed/vllm_offload_claimed.mmap",
            )
        ]
        patch_offload_node_spec(kube_api, NODE, {"reclaims": requests})

        def results() -> dict[str, dict[str, str]]:
            status = offload_node(kube_api, NODE).get("status") or {}
            return {r["path"]: r for r in status.get("reclaims") or []}

        done = wait_for(lambda: len(results()) == 2 and results(), 20, "two reclaim results")
        assert done["team/orphan/vllm_offload_orphan.mmap"]["outcome"] == "Done"
        assert done["team/claimed/vllm_offload_claimed.mmap"]["outcome"] == "RefusedClaimed"
        assert not (root / "team" / "orphan").exists()
        assert (root / "team" / "claimed" / "vllm_offload_claimed.mmap").exists()
        node_events = [e["reason"] for e in events(kube_api, "default")]
        assert "Reclaimed" in node_events and "ReclaimRefused" in node_events


def _plant_hostile_entries(root: Path, outside: Path) -> dict[str, str]:
    """One region per planted hazard (under namespace "team" or a namespace of its own);
    returns region name -> what its Failed message must say."""

    def region_file(name: str) -> Path:
        return region_dir(root, f"team/{name}") / f"vllm_offload_{name}.mmap"

    region_file("file-symlink").symlink_to(outside / "secret")
    os.mkfifo(region_file("fifo"))
    os.link(outside / "sized", region_file("hardlink"))
    region_file("directory").mkdir()
    (root / "team" / "dir-symlink").symlink_to(outside)
    (root / "team" / "dir-file").write_bytes(b"")
    (root / "evil").symlink_to(outside)  # a whole namespace
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
    kube_api: KubeApi, kubeconfig: Path, shm_dir: Path
) -> None:
    setup_cluster(kube_api, "team", "evil", nodes={NODE: {}})
    root = shm_dir / "root"
    outside = shm_dir / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"keep")
    (outside / "sized").write_bytes(b"\0" * 2097152)  # the right size for the hard link
    before = {
        p.name: (p.lstat().st_mode, p.lstat().st_uid, p.lstat().st_size) for p in outside.iterdir()
    }
    expected = _plant_hostile_entries(root, outside)
    owner = {"uid": 777, "gid": 777, "mode": 0o600}
    regions = {
        name: create_region(
            kube_api,
            manifest("r", "evil", access=owner)
            if name == "ns-symlink"
            else manifest(name, "team", access=owner),
        )
        for name in expected
    }
    with running_agent(kubeconfig, NODE, root):
        for name, region in regions.items():
            wait_for(lambda r=region: phase_of(kube_api, r, NODE) == "Failed", 30, name)
            message = node_status(kube_api, region, NODE)["message"]
            assert expected[name] in message, (name, message)
        condition = wait_for(
            lambda: [
                c
                for c in (offload_node(kube_api, NODE).get("status") or {}).get("conditions") or []
                if c["type"] == "RootSafe" and c["status"] == "False"
            ],
            10,
            "RootSafe False",
        )[0]
        assert "symbolic link" in condition["message"] and "FIFO" in condition["message"]
    after = {
        p.name: (p.lstat().st_mode, p.lstat().st_uid, p.lstat().st_size) for p in outside.iterdir()
    }
    assert after == before
    assert (outside / "secret").read_bytes() == b"keep"


def test_a_dropped_watch_is_restarted_counted_and_changes_still_arrive(
    kube_api: KubeApi, kubeconfig: Path, shm_dir: Path
) -> None:
    setup_cluster(kube_api, "team", nodes={NODE: {}})
    with running_agent(kubeconfig, NODE, shm_dir / "root") as app:
        first = create_region(kube_api, manifest("one", "team"))
        wait_for(lambda: phase_of(kube_api, first, NODE) == "Ready", 30, "one Ready")
        kube_api.drop_watches()
        kube_api.compact()  # and the old resource version is gone too (410 on resume)
        second = create_region(kube_api, manifest("two", "team"))
        wait_for(lambda: phase_of(kube_api, second, NODE) == "Ready", 30, "two Ready")
        restarts = app.metrics.registry.get_sample_value("kvshm_agent_watch_restarts_total")
        assert restarts is not None and restarts >= 1


def test_other_agents_status_patches_do_not_wake_this_agent(
    kube_api: KubeApi, kubeconfig: Path, shm_dir: Path
) -> None:
    setup_cluster(kube_api, "team", nodes={NODE: {}})
    region = create_region(kube_api, manifest("quiet", "team"))
    with running_agent(kubeconfig, NODE, shm_dir / "root", "--resync-seconds", "30") as app:
        wait_for(lambda: phase_of(kube_api, region, NODE) == "Ready", 30, "Ready")
        time.sleep(1.5)  # the passes that follow Ready (and our own patches' echoes) are over
        passes = []
        real = app.reconciler.reconcile
        app.reconciler.reconcile = lambda view: passes.append(1) or real(view)  # type: ignore[method-assign]
        for i in range(20):  # another node's agent reporting progress
            other = {"phase": "Populating", "populatedBytes": i}
            kube_api.call(
                lambda s, o=other: s.patch(
                    s.resource("kvshm.dev", "v1alpha1", "offloadregions"),
                    "team",
                    "quiet",
                    "application/merge-patch+json",
                    {"status": {"nodes": {"node-z": o}}},
                    "status",
                )
            )
        time.sleep(1.0)
        assert len(passes) <= 1, f"{len(passes)} passes for 20 foreign status patches"
        patch_region(kube_api, "team", "quiet", {"spec": {"lock": False}})  # a spec change does
        wait_for(lambda: node_status(kube_api, region, NODE).get("locked") is False, 10, "unlock")
        assert len(passes) >= 1


def test_a_deleted_offload_node_is_made_again(
    kube_api: KubeApi, kubeconfig: Path, shm_dir: Path
) -> None:
    setup_cluster(kube_api, "team", nodes={NODE: {}})
    with running_agent(kubeconfig, NODE, shm_dir / "root"):
        wait_for(lambda: (offload_node(kube_api, NODE).get("status") or {}).get("heartbeat"), 10)
        kube_api.call(
            lambda s: s.delete(s.resource("kvshm.dev", "v1alpha1", "offloadnodes"), None, NODE)
        )

        def heartbeat() -> str | None:
            try:
                return (offload_node(kube_api, NODE).get("status") or {}).get("heartbeat")
            except Exception:  # not found yet
                return None

        assert wait_for(heartbeat, 15, "a new OffloadNode with a heartbeat")
