"""Status aggregation: phase, conditions and counts from the agents' reports."""

from __future__ import annotations

from datetime import timedelta

from kvshm.api import NodeRegionPhase, NodeReport, RegionPhase
from kvshm.api.conditions import ConditionType
from kvshm.operator.phases import derive_invalid, derive_status, status_patch, worth_writing
from tests.operator.builders import NOW, agent, cluster, region, reports

TWO = region(node_names=["a", "b"])


def test_no_reports_yet_is_pending() -> None:
    status = derive_status(TWO, {}, cluster(["a", "b"]))
    assert status.phase is RegionPhase.PENDING
    assert (status.ready_nodes, len(status.target_nodes)) == (0, 2)


def test_some_nodes_working_is_provisioning() -> None:
    status = derive_status(TWO, reports(a="Ready", b="Populating"), cluster(["a", "b"]))
    assert status.phase is RegionPhase.PROVISIONING
    assert status.ready_nodes == 1
    assert "b: Populating" in status.message


def test_a_ready_report_that_names_no_generation_is_not_ready() -> None:
    unsaid = {"a": NodeReport(NodeRegionPhase.READY)}
    status = derive_status(region(node_names=["a"]), unsaid, cluster(["a"]))
    assert status.phase is RegionPhase.PROVISIONING and status.ready_nodes == 0


def test_every_target_ready_is_ready_with_true_condition() -> None:
    status = derive_status(TWO, reports(a="Ready", b="Ready"), cluster(["a", "b"]))
    assert status.phase is RegionPhase.READY
    ready = status.condition(ConditionType.READY)
    assert ready is not None and ready.status is True
    degraded = status.condition(ConditionType.DEGRADED)
    assert degraded is not None and degraded.status is False


def test_one_node_failed_is_degraded_with_the_agents_message() -> None:
    status = derive_status(TWO, reports(a="Ready", b="Failed: no space left"), cluster(["a", "b"]))
    assert status.phase is RegionPhase.DEGRADED
    degraded = status.condition(ConditionType.DEGRADED)
    assert degraded is not None and degraded.status is True
    assert degraded.reason == "NodeFailed" and "no space left" in degraded.message


def test_every_node_failed_is_failed() -> None:
    status = derive_status(TWO, reports(a="Failed: x", b="Failed: y"), cluster(["a", "b"]))
    assert status.phase is RegionPhase.FAILED


def test_a_silent_agent_degrades_a_ready_region_with_a_reason() -> None:
    view = cluster(["a", "b"], [agent("a"), agent("b", heartbeat_age=300)])
    status = derive_status(TWO, reports(a="Ready", b="Ready"), view)
    assert status.phase is RegionPhase.DEGRADED
    degraded = status.condition(ConditionType.DEGRADED)
    assert degraded is not None and degraded.reason == "AgentSilent"
    assert "b" in degraded.message and "300s" in degraded.message


def test_a_node_deleted_under_its_live_agent_degrades_and_still_counts() -> None:
    view = cluster(["b"], [agent("a"), agent("b")])  # Node a deleted; its agent reports
    for placed in (TWO, region()):  # by name, and on every node
        status = derive_status(placed, reports(a="Ready", b="Ready"), view)
        assert status.phase is RegionPhase.DEGRADED
        assert (status.ready_nodes, status.target_nodes) == (2, ("a", "b"))
        degraded = status.condition(ConditionType.DEGRADED)
        assert degraded is not None and degraded.reason == "NodeDeleted"
        assert "a was deleted" in degraded.message


def test_many_problems_are_summarised_within_a_condition() -> None:
    names = [f"node-{i:04d}-{'x' * 200}" for i in range(300)]
    view = cluster(names)
    failed = {name: f"Failed: {'no space left ' * 300}" for name in names}
    status = derive_status(region(node_names=names), reports(**failed), view)
    degraded = status.condition(ConditionType.DEGRADED)
    assert degraded is not None and len(degraded.message) <= 32768
    assert degraded.message.endswith("more problems")
    assert "provisioning" not in status.message
    patch = status_patch(None, status, NOW)
    assert len(patch["message"]) <= 4096


def test_a_node_without_agent_degrades_when_others_can_serve() -> None:
    view = cluster(["a", "b"], [agent("a")])
    status = derive_status(TWO, reports(a="Ready"), view)
    assert status.phase is RegionPhase.DEGRADED
    assert "no OffloadNode" in status.message


def test_rejected_placement_is_failed_and_not_accepted() -> None:
    status = derive_status(region(node_names=["ghost"]), {}, cluster(["a"]))
    assert status.phase is RegionPhase.FAILED
    accepted = status.condition(ConditionType.ACCEPTED)
    assert accepted is not None and accepted.status is False
    assert accepted.reason == "UnknownNode" and "ghost" in accepted.message


def test_partly_unknown_nodes_degrade_what_works() -> None:
    status = derive_status(region(node_names=["a", "ghost"]), reports(a="Ready"), cluster(["a"]))
    assert status.phase is RegionPhase.DEGRADED
    assert "ghost" in status.message


def test_waiting_placement_is_pending_with_unknown_acceptance() -> None:
    status = derive_status(region(), {}, cluster(["a"], []))
    assert status.phase is RegionPhase.PENDING
    accepted = status.condition(ConditionType.ACCEPTED)
    assert accepted is not None and accepted.status is None


def test_a_ready_report_for_an_older_generation_is_not_ready() -> None:
    stale = {
        "a": NodeReport(NodeRegionPhase.READY, observed_generation=1),
        "b": NodeReport(NodeRegionPhase.READY, observed_generation=2),
    }
    status = derive_status(region(node_names=["a", "b"], generation=2), stale, cluster(["a", "b"]))
    assert status.phase is RegionPhase.PROVISIONING
    assert status.ready_nodes == 1


def test_reports_of_gone_nodes_are_dropped_and_do_not_count() -> None:
    view = cluster(["a"], [agent("a")])  # node b: no Node, no agent
    status = derive_status(region(), reports(a="Ready", b="Ready"), view)
    assert status.gone_nodes == ("b",)
    assert status.phase is RegionPhase.READY


def test_deleting_is_terminating_with_the_nodes_still_draining() -> None:
    status = derive_status(TWO, reports(a="Removed", b="Draining"), cluster(["a", "b"]), True)
    assert status.phase is RegionPhase.TERMINATING
    drained = status.condition(ConditionType.DRAINED)
    assert drained is not None and drained.status is False
    assert drained.reason == "Draining" and "b" in drained.message


def test_invalid_spec_is_failed_with_the_parsers_message() -> None:
    status = derive_invalid("spec.layout: numBlocks must be at least 1", 3)
    assert status.phase is RegionPhase.FAILED
    assert status.observed_generation == 3
    accepted = status.condition(ConditionType.ACCEPTED)
    assert accepted is not None and "numBlocks" in accepted.message


def test_a_spec_turned_invalid_drops_the_size_of_the_valid_one() -> None:
    valid = status_patch({}, derive_status(TWO, reports(a="Ready"), cluster(["a", "b"])), NOW)
    invalid = status_patch(valid, derive_invalid("spec.layout: bad", 2), NOW)
    assert invalid["nodesWanted"] == 0
    assert "sizeBytes" in invalid and invalid["sizeBytes"] is None  # null: removed
    assert "size" in invalid and invalid["size"] is None
    assert "sizeBytes" not in status_patch({}, derive_invalid("spec.layout: bad", 2), NOW)


def test_status_patch_is_empty_when_status_is_current() -> None:
    derived = derive_status(TWO, reports(a="Ready", b="Ready"), cluster(["a", "b"]))
    first = status_patch({}, derived, NOW)
    assert first["phase"] == "Ready"
    assert (first["nodesReady"], first["nodesWanted"], first["sizeBytes"]) == (2, 2, 2**30)
    assert first["size"] == "1Gi"  # the Size column kubectl prints
    assert status_patch(first, derived, NOW + timedelta(minutes=5)) == {}


def test_status_patch_keeps_transition_times_of_unchanged_conditions() -> None:
    view = cluster(["a", "b"])
    provisioning = status_patch({}, derive_status(TWO, reports(a="Ready"), view), NOW)
    later = NOW + timedelta(minutes=1)
    ready = status_patch(
        provisioning, derive_status(TWO, reports(a="Ready", b="Ready"), view), later
    )
    times = {c["type"]: c["lastTransitionTime"] for c in ready["conditions"]}
    assert times["Accepted"] == "2026-11-22T12:00:00Z"  # stayed True
    assert times["Ready"] == "2026-11-22T12:01:00Z"  # became True


def test_status_patch_removes_entries_of_gone_nodes() -> None:
    view = cluster(["a"], [agent("a")])
    derived = derive_status(region(), reports(a="Ready", b="Ready"), view)
    assert status_patch({}, derived, NOW)["nodes"] == {"b": None}


def test_worth_writing_any_change_but_only_reasons_while_terminating() -> None:
    view = cluster(["a", "b"])
    provisioning = derive_status(TWO, reports(a="Ready"), view)
    ready = derive_status(TWO, reports(a="Ready", b="Ready"), view)
    assert worth_writing(None, provisioning)
    assert worth_writing(provisioning, ready) and not worth_writing(ready, ready)
    both = derive_status(TWO, reports(a="Draining", b="Draining"), view, True)
    one = derive_status(TWO, reports(a="Removed", b="Draining"), view, True)
    done = derive_status(TWO, reports(a="Removed", b="Removed"), view, True)
    assert worth_writing(ready, both)
    assert not worth_writing(both, one)  # only the list of nodes still draining changed
    assert worth_writing(one, done)  # Drained became True
