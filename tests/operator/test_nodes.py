"""OffloadNode-wide decisions: removal of gone nodes, and the spec written for the agent."""

from __future__ import annotations

from datetime import timedelta

import pytest

from kvshm.api.reading import MAX_RECLAIMS, MAX_RETAINED
from kvshm.operator.kube import SpecRefused
from kvshm.operator.nodes import (
    RETAINED_MAX_BYTES,
    add_retained,
    forget_retained,
    reclaims_after,
    removal_reason,
    retained_entry,
)
from kvshm.operator.orphans import OrphanClock, decide_reclaims
from tests.api.admission import CRD_DOCUMENTS, schema_nodes
from tests.operator.builders import NOW, agent, cluster, file

NODE_CRD = next(c for c in CRD_DOCUMENTS if c["spec"]["names"]["kind"] == "OffloadNode")
NODE_SCHEMA = dict(schema_nodes(NODE_CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]))


def test_the_operators_list_bounds_are_the_crds() -> None:
    assert NODE_SCHEMA["spec.reclaims"]["maxItems"] == MAX_RECLAIMS
    assert NODE_SCHEMA["spec.retained"]["maxItems"] == MAX_RETAINED


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


def test_reclaims_after_never_writes_more_than_the_crd_allows() -> None:
    pending = tuple(f"team/p{i}/vllm_offload_p{i}.mmap" for i in range(MAX_RECLAIMS - 2))
    due = tuple(
        file(f"team/o{i}/vllm_offload_o{i}.mmap", orphaned_since=NOW - timedelta(hours=i + 1))
        for i in range(5)
    )
    node = agent("a", files=due, requests=pending)
    decision = decide_reclaims(node, (), OrphanClock(), NOW, 60.0)
    entries = reclaims_after(node, decision, NOW)
    assert entries is not None and len(entries) == MAX_RECLAIMS
    # the two oldest orphans are requested now, the other three by a later sweep
    assert [d.path for d in decision.requests] == [due[4].path, due[3].path]
    assert sorted(d.path for d in decision.deferred) == sorted(f.path for f in due[:3])

    answered = agent("a", files=due[:3], requests=pending, results=dict.fromkeys(pending, "Done"))
    later = decide_reclaims(answered, (), OrphanClock(), NOW, 60.0)
    assert len(later.requests) == 3 and later.deferred == ()


def test_add_retained_refuses_past_the_crds_bound_and_names_the_way_out() -> None:
    entry = retained_entry("team/r", "team/r/vllm_offload_r.mmap", NOW)
    almost = {"retained": [{"path": f"a/b{i}/vllm_offload_{i}.mmap"} for i in range(9999)]}
    written = add_retained(entry)(almost)
    assert written is not None and len(written["retained"]) == MAX_RETAINED
    another = retained_entry("team/s", "team/s/vllm_offload_s.mmap", NOW)
    with pytest.raises(SpecRefused, match=r"spec\.retained is full .*kubectl edit onode"):
        add_retained(another)(written)
    assert add_retained(entry)(written) is None  # listed already: nothing to add


def test_add_retained_refuses_a_list_larger_than_its_share_of_the_object() -> None:
    long = "n" * 63 + "/" + "r" * 253 + "/vllm_offload_{}.mmap"
    count = RETAINED_MAX_BYTES // len(long) + 1
    spec = {"retained": [{"path": long.format(i)} for i in range(count)]}
    assert count < MAX_RETAINED
    with pytest.raises(SpecRefused, match="bytes"):
        add_retained(retained_entry("team/r", "team/r/vllm_offload_r.mmap", NOW))(spec)
