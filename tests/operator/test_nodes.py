"""OffloadNode-wide decisions: removal of gone nodes, and the spec written for the agent."""

from __future__ import annotations

from datetime import timedelta

from kvshm.operator.nodes import (
    add_retained,
    forget_retained,
    reclaims_after,
    removal_reason,
    retained_entry,
)
from kvshm.operator.orphans import OrphanClock, decide_reclaims
from tests.operator.builders import NOW, agent, cluster, file


def test_an_offload_node_is_removed_only_when_node_gone_and_agent_silent() -> None:
    silent = agent("b", heartbeat_age=600)
    alive = agent("b", heartbeat_age=1)
    assert removal_reason(silent, cluster(["a"], [silent])) is not None
    assert removal_reason(alive, cluster(["a"], [alive])) is None  # re-registering node
    assert removal_reason(silent, cluster(["a", "b"], [silent])) is None  # node still there


def test_reclaims_after_adds_requests_and_drops_answered_ones() -> None:
    orphan = file("team/x/vllm_offload_x.mmap", size=10)
    node = agent("a", files=(orphan,), requests=("team/y/vllm_offload_y.mmap",))
    first = decide_reclaims(node, (), OrphanClock(), NOW, 0.0)
    entries = reclaims_after(node, first, NOW)
    assert entries is not None
    assert [e["path"] for e in entries] == [
        "team/x/vllm_offload_x.mmap",
        "team/y/vllm_offload_y.mmap",
    ]
    new = entries[0]
    assert new["sizeBytes"] == 10 and new["requestedAt"] == "2026-11-22T12:00:00Z"
    assert new["reason"].startswith("orphaned since")

    answered = agent(
        "a",
        requests=("team/y/vllm_offload_y.mmap",),
        results={"team/y/vllm_offload_y.mmap": "Done"},
    )
    decision = decide_reclaims(answered, (), OrphanClock(), NOW, 60.0)
    assert reclaims_after(answered, decision, NOW) == []


def test_reclaims_after_leaves_the_spec_alone_when_nothing_changes() -> None:
    node = agent("a", files=(file(held=True),))
    decision = decide_reclaims(node, (), OrphanClock(), NOW + timedelta(hours=1), 60.0)
    assert reclaims_after(node, decision, NOW) is None


def test_retained_edits_add_once_and_forget_by_path() -> None:
    entry = retained_entry("team/r", "team/r/vllm_offload_r.mmap", NOW)
    written = {"path": entry.path, "region": "team/r", "retainedAt": "2026-11-22T12:00:00Z"}
    added = add_retained(entry)({})
    assert added == {"retained": [written]}
    assert add_retained(entry)(added) is None
    other = {"path": "team/q/vllm_offload_q.mmap"}
    spec = {"retained": [written, other]}
    assert forget_retained({entry.path})(spec) == {"retained": [other]}
    assert forget_retained({"nothing"})(spec) is None
