"""What the operator owes a region now (regions.plan_region) and the finalizer's JSON patches:
writes only where they carry news, each decided from the region as seen."""

from __future__ import annotations

from typing import Any

from kvshm.operator.finalizers import add_ops, remove_ops
from kvshm.operator.regions import RegionPlan, plan_region
from tests.operator.builders import FINALIZER, NOW, agent, cluster, region_body


def plan(region: dict[str, Any], **view: Any) -> RegionPlan:
    return plan_region(region, view.get("cluster") or cluster(["a"]), FINALIZER, NOW)


def written(region: dict[str, Any], result: RegionPlan) -> dict[str, Any]:
    """The region as it is once the plan's status is written."""
    status = {**region["status"], **(result.status or {})}
    return {**region, "status": status}


def test_a_new_region_gets_the_finalizer_at_once_and_its_pending_status_later() -> None:
    result = plan(region_body())
    assert result.add_finalizer
    assert result.status is not None and result.status["phase"] == "Pending"
    assert not result.write_now  # an agent that reports soon makes this write needless


def test_ready_is_written_at_once_and_announced_once() -> None:
    region = region_body(nodes={"a": "Ready"}, finalizers=[FINALIZER])
    result = plan(region)
    assert not result.add_finalizer
    assert result.status is not None and result.status["phase"] == "Ready" and result.write_now
    assert [(n.reason, n.warning) for n in result.announcements] == [("Ready", False)]
    assert plan(written(region, result)).status is None  # nothing left to write


def test_an_earlier_operators_kopf_records_go_with_the_next_status_write() -> None:
    old = {"kopf": {"progress": {"release": {"retries": 1}}}}
    result = plan(region_body(nodes={"a": "Ready"}, finalizers=[FINALIZER], status=old))
    assert result.status is not None and result.status["kopf"] is None
    assert (
        plan(region_body(finalizers=[FINALIZER], status={"phase": "Ready", **old})).status
        is not None
    )


def test_progress_on_the_way_is_written_only_when_phase_or_counts_change() -> None:
    both = cluster(["a", "b"])
    placement = {"nodeNames": ["a", "b"]}
    creating = region_body(nodes={"a": "Creating"}, finalizers=[FINALIZER], placement=placement)
    first = plan(creating, cluster=both)
    assert first.status is not None and first.status["phase"] == "Provisioning"
    assert not first.write_now
    now_written = written(creating, first)
    # node-b starts too: only the message (which node got how far) would change
    later = {**now_written, "status": {**now_written["status"], "nodes": {
        "a": {"phase": "Populating", "observedGeneration": 1},
        "b": {"phase": "Creating", "observedGeneration": 1},
    }}}  # fmt: skip
    assert plan(later, cluster=both).status is None


def test_a_rejected_spec_is_announced_once_per_generation() -> None:
    region = region_body(placement={"nodeNames": ["ghost"]}, finalizers=[FINALIZER])
    result = plan(region)
    assert result.status is not None and result.status["phase"] == "Failed" and result.write_now
    reasons = {n.reason for n in result.announcements if n.warning}
    assert reasons == {"UnknownNode", "Failed"}
    assert plan(written(region, result)).announcements == ()
    edited = written(region, result)
    edited["metadata"] = {**edited["metadata"], "generation": 2}
    again = plan(edited)
    assert "UnknownNode" in {n.reason for n in again.announcements}


def test_a_deletion_waits_for_the_agents_without_writing_at_once() -> None:
    region = region_body(nodes={"a": "Draining"}, finalizers=[FINALIZER], deleting=True)
    result = plan(region)
    assert not result.release
    assert result.status is not None and result.status["phase"] == "Terminating"
    assert not result.write_now


def test_release_writes_nothing_but_the_finalizer() -> None:
    result = plan(region_body(nodes={"a": "Removed"}, finalizers=[FINALIZER], deleting=True))
    assert result.release and result.status is None and result.announcements == ()


def test_a_silent_agent_is_released_with_a_warning() -> None:
    view = cluster(["a"], [agent("a", heartbeat_age=600)])
    result = plan(
        region_body(nodes={"a": "Ready"}, finalizers=[FINALIZER], deleting=True), cluster=view
    )
    assert result.release
    assert [(n.reason, n.warning) for n in result.announcements] == [("AgentSilent", True)]


def test_retain_releases_at_once_naming_the_nodes_that_keep_files() -> None:
    region = region_body(
        nodes={"a": "Ready"}, finalizers=[FINALIZER], deleting=True, policy="Retain"
    )
    result = plan(region)
    assert result.release and result.retained == ("a",)
    assert [n.reason for n in result.announcements] == ["Retained"]


def test_a_deleted_region_that_is_not_held_is_left_alone() -> None:
    assert plan(region_body(deleting=True, finalizers=["someone.else/f"])) == RegionPlan()


def test_the_finalizer_is_added_against_the_finalizers_as_seen_never_a_version() -> None:
    meta: dict[str, Any] = {"uid": "u1", "resourceVersion": "7"}
    assert add_ops(meta, FINALIZER) == [
        {"op": "test", "path": "/metadata/uid", "value": "u1"},
        {"op": "test", "path": "/metadata/finalizers", "value": None},  # absent, so far
        {"op": "add", "path": "/metadata/finalizers", "value": [FINALIZER]},
    ]
    meta["finalizers"] = ["other/f"]
    ops = add_ops(meta, FINALIZER)
    assert ops is not None and ops[1]["value"] == ["other/f"]
    assert ops[2] == {"op": "add", "path": "/metadata/finalizers/-", "value": FINALIZER}
    assert not any(op["path"] == "/metadata/resourceVersion" for op in ops)
    assert add_ops({"finalizers": [FINALIZER]}, FINALIZER) is None


def test_the_finalizer_is_removed_by_position_after_checking_it_is_there() -> None:
    ops = remove_ops({"uid": "u1", "finalizers": ["other/f", FINALIZER]}, FINALIZER)
    assert ops == [
        {"op": "test", "path": "/metadata/uid", "value": "u1"},
        {"op": "test", "path": "/metadata/finalizers/1", "value": FINALIZER},
        {"op": "remove", "path": "/metadata/finalizers/1"},
    ]
    assert remove_ops({"finalizers": ["other/f"]}, FINALIZER) is None
