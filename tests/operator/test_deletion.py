"""When a deleted region's finalizer may be released."""

from __future__ import annotations

from kvshm.api import ReclaimPolicy
from kvshm.operator.deletion import AbandonReason, decide_release
from tests.operator.builders import agent, cluster, reports

DELETE, RETAIN = ReclaimPolicy.DELETE, ReclaimPolicy.RETAIN


def test_waits_while_any_live_node_still_holds_files() -> None:
    decision = decide_release(DELETE, reports(a="Removed", b="Draining"), cluster(["a", "b"]))
    assert not decision.release
    assert decision.waiting == ("b",)
    assert "b" in decision.summary


def test_releases_once_every_node_reports_removed() -> None:
    decision = decide_release(DELETE, reports(a="Removed", b="Removed"), cluster(["a", "b"]))
    assert decision.release and decision.reason == "FilesRemoved"


def test_never_reported_is_nothing_to_wait_for() -> None:
    assert decide_release(DELETE, {}, cluster(["a"])).release


def test_a_failed_node_is_waited_for_too() -> None:
    # a Failed node may have left a partial file: its agent must clean up and say Removed
    decision = decide_release(DELETE, reports(a="Failed: x"), cluster(["a"]))
    assert decision.waiting == ("a",)


def test_a_silent_agent_is_given_up_on_visibly() -> None:
    view = cluster(["a", "b"], [agent("a"), agent("b", heartbeat_age=600)])
    decision = decide_release(DELETE, reports(a="Removed", b="Ready"), view)
    assert decision.release
    assert [(item.node, item.reason) for item in decision.abandoned] == [
        ("b", AbandonReason.AGENT_SILENT)
    ]
    assert decision.reason == "AgentSilent" and "600s" in decision.summary


def test_a_recent_heartbeat_keeps_the_wait() -> None:
    view = cluster(["b"], [agent("b", heartbeat_age=59)])
    assert not decide_release(DELETE, reports(b="Draining"), view).release


def test_a_gone_node_is_given_up_on_as_node_gone() -> None:
    view = cluster(["a"], [agent("a")])
    decision = decide_release(DELETE, reports(a="Removed", b="Ready"), view)
    assert decision.release
    assert decision.abandoned[0].reason is AbandonReason.NODE_GONE


def test_retain_releases_at_once_and_names_the_nodes_keeping_files() -> None:
    decision = decide_release(RETAIN, reports(a="Ready", b="Removed"), cluster(["a", "b"]))
    assert decision.release
    assert decision.retained == ("a",)
    assert "Retain" in decision.summary
