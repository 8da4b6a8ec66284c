"""Orphan reclaim decisions: continuously orphaned past the grace period, never held or claimed."""

from __future__ import annotations

import dataclasses
import itertools
from datetime import timedelta

from kvshm.api import (
    NodeInventory,
    NodeName,
    OffloadNode,
    ReclaimOutcome,
    ReclaimRequest,
    ReclaimResult,
    RetainedFile,
    parse_offload_node,
)
from kvshm.api.events import EventReason
from kvshm.operator import metrics
from kvshm.operator.nodes import reclaims_after
from kvshm.operator.orphans import (
    RECLAIM_RETRY_FIRST_SECONDS,
    RECLAIM_RETRY_MAX_SECONDS,
    OrphanClock,
    Refusal,
    announcements,
    decide_reclaims,
)
from tests.operator.builders import NOW, agent, file

GRACE = 60.0
ORPHAN = file("team/old/vllm_offload_old.mmap", size=8192)


def sweep(inventory, clock=None, at=0.0, claimed=(), dry_run=False):  # type: ignore[no-untyped-def]
    return decide_reclaims(
        inventory,
        claimed,
        clock or OrphanClock(),
        NOW + timedelta(seconds=at),
        GRACE,
        dry_run,
    )


def test_an_orphan_is_requested_only_after_the_grace_period() -> None:
    node = agent("a", files=(ORPHAN,))
    first = sweep(node)
    assert first.requests == ()
    assert [r.reason for r in first.refusals] == [Refusal.GRACE]
    assert first.orphans == (ORPHAN,) and first.orphaned_bytes == 8192
    early = sweep(node, first.clock, at=GRACE - 1)
    assert early.requests == () and early.refusals == ()  # the grace refusal is counted once
    due = sweep(node, early.clock, at=GRACE)
    assert [r.path for r in due.requests] == [ORPHAN.path]
    assert due.requests[0].orphaned_since == NOW


def test_being_held_in_between_restarts_the_clock() -> None:
    first = sweep(agent("a", files=(ORPHAN,)))
    held = file(ORPHAN.path, held=True)
    middle = sweep(agent("a", files=(held,)), first.clock, at=30)
    assert [r.reason for r in middle.refusals] == [Refusal.HELD]
    again = sweep(agent("a", files=(ORPHAN,)), middle.clock, at=GRACE + 1)
    assert again.requests == ()  # orphaned again only since 61s, not 0s
    due = sweep(agent("a", files=(ORPHAN,)), again.clock, at=2 * GRACE + 1)
    assert len(due.requests) == 1


def test_a_held_file_is_never_requested() -> None:
    held = file(held=True)
    clock = OrphanClock()
    for at in (0, GRACE, 10 * GRACE):
        decision = sweep(agent("a", files=(held,)), clock, at=at)
        assert decision.requests == () and decision.orphans == ()
        clock = decision.clock


def test_a_file_the_agent_calls_claimed_is_never_requested_nor_counted_as_refused() -> None:
    claimed = file(claimed_by="team/live")
    decision = sweep(agent("a", files=(claimed,)), at=10 * GRACE)
    assert decision.requests == () and decision.refusals == ()


def test_a_file_an_existing_region_names_is_refused_as_claimed_even_if_the_agent_disagrees() -> (
    None
):
    decision = sweep(agent("a", files=(ORPHAN,)), claimed=[ORPHAN.path], at=10 * GRACE)
    assert decision.requests == ()
    assert [r.reason for r in decision.refusals] == [Refusal.CLAIMED]


def test_an_unknown_held_state_counts_as_held() -> None:
    body = {
        "metadata": {"name": "a"},
        "status": {"files": [{"path": ORPHAN.path, "sizeBytes": 1, "claimedBy": ""}]},
    }
    node = parse_offload_node(body)
    assert node is not None
    decision = sweep(node, at=10 * GRACE)
    assert decision.orphans == () and decision.requests == ()


def test_a_pending_request_that_became_unsafe_is_withdrawn() -> None:
    held = file(ORPHAN.path, held=True)
    decision = sweep(agent("a", files=(held,), requests=(ORPHAN.path,)))
    assert [(w.path, w.reason) for w in decision.withdrawals] == [(ORPHAN.path, Refusal.HELD)]


def test_a_pending_request_is_not_requested_twice() -> None:
    first = sweep(agent("a", files=(ORPHAN,)))
    decision = sweep(agent("a", files=(ORPHAN,), requests=(ORPHAN.path,)), first.clock, at=GRACE)
    assert decision.requests == ()


def test_answered_requests_are_closed_with_their_outcome() -> None:
    node = agent("a", requests=(ORPHAN.path,), results={ORPHAN.path: "Done", "x": "Done"})
    decision = sweep(node)
    assert [(r.path, r.outcome.value) for r in decision.results] == [(ORPHAN.path, "done")]


def test_dry_run_announces_once_and_requests_nothing() -> None:
    first = sweep(agent("a", files=(ORPHAN,)), dry_run=True)
    due = sweep(agent("a", files=(ORPHAN,)), first.clock, at=GRACE, dry_run=True)
    assert due.requests == () and [r.path for r in due.would_reclaim] == [ORPHAN.path]
    later = sweep(agent("a", files=(ORPHAN,)), due.clock, at=2 * GRACE, dry_run=True)
    assert later.would_reclaim == ()


def test_retained_files_are_orphans_but_never_requested() -> None:
    node = agent("a", files=(ORPHAN,), retained=(ORPHAN.path,))
    first = sweep(node)
    decision = sweep(node, first.clock, at=10 * GRACE)
    assert decision.orphans == (ORPHAN,) and decision.requests == ()
    assert decision.forget_retained == ()


def test_retained_entries_are_forgotten_when_the_file_is_gone_or_claimed_again() -> None:
    claimed = file("team/back/vllm_offload_back.mmap", claimed_by="team/back")
    node = agent("a", files=(claimed,), retained=(claimed.path, "team/gone/vllm_offload_g.mmap"))
    assert sweep(node).forget_retained == (claimed.path, "team/gone/vllm_offload_g.mmap")


def test_the_deleted_regions_own_claim_does_not_undo_its_retention() -> None:
    """Release marks the file retained while its region is still deleting and its agent still
    reports the claim; forgetting then would let the orphan sweep reclaim a Retain region."""
    path = "team/kept/vllm_offload_kept.mmap"
    stale = file(path, claimed_by="team/kept")
    node = dataclasses.replace(
        agent("a", files=(stale,)),
        retained=(RetainedFile(path, "team/kept"),),
    )
    assert sweep(node, claimed=(path,)).forget_retained == ()  # deleting: claimed, not live
    recreated = decide_reclaims(node, (path,), OrphanClock(), NOW, GRACE, live_paths=(path,))
    assert recreated.forget_retained == (path,)  # the region exists again: in use


def test_the_grace_period_survives_an_operator_restart() -> None:
    """The agent publishes when it first saw the file unclaimed: an operator that restarts
    (and so forgets its clock) resumes the grace period instead of starting it again."""
    orphan = file(ORPHAN.path, orphaned_since=NOW)
    before = sweep(agent("a", files=(orphan,)), at=GRACE / 2)
    assert before.requests == ()
    restarted = sweep(agent("a", files=(orphan,)), OrphanClock(), at=GRACE)
    assert [(r.path, r.orphaned_since) for r in restarted.requests] == [(ORPHAN.path, NOW)]


def test_an_orphan_older_than_the_operator_is_due_at_once() -> None:
    orphan = file(ORPHAN.path, orphaned_since=NOW - timedelta(seconds=2 * GRACE))
    decision = sweep(agent("a", files=(orphan,)))
    assert [r.path for r in decision.requests] == [ORPHAN.path]


def test_a_file_seen_held_starts_again_whatever_the_agents_time() -> None:
    """The agent's time counts unclaimed time only; a holder this operator saw restarts it."""
    long_ago = NOW - timedelta(seconds=10 * GRACE)
    held = file(ORPHAN.path, held=True, orphaned_since=long_ago)
    orphan = file(ORPHAN.path, orphaned_since=long_ago)
    middle = sweep(agent("a", files=(held,)))
    again = sweep(agent("a", files=(orphan,)), middle.clock, at=1)
    assert again.requests == ()
    due = sweep(agent("a", files=(orphan,)), again.clock, at=GRACE + 1)
    assert [r.orphaned_since for r in due.requests] == [NOW + timedelta(seconds=1)]


def test_a_claim_only_the_agent_saw_between_sweeps_restarts_the_time() -> None:
    first = sweep(agent("a", files=(file(ORPHAN.path, orphaned_since=NOW),)))
    reclaimed_later = NOW + timedelta(seconds=30)
    later = file(ORPHAN.path, orphaned_since=reclaimed_later)
    decision = sweep(agent("a", files=(later,)), first.clock, at=GRACE + 1)
    assert decision.requests == ()
    assert decision.clock.since[ORPHAN.path] == reclaimed_later


def _run_sweeps_against_an_agent_that_fails(minutes: int) -> list[float]:
    """Sweeps every 5 s against an agent that answers every request Failed at once: the
    seconds (from NOW) at which a request was written."""
    orphan = file(ORPHAN.path, orphaned_since=NOW - timedelta(hours=1))
    requests: tuple[ReclaimRequest, ...] = ()
    results: tuple[ReclaimResult, ...] = ()
    clock, written = OrphanClock(), []
    for step in range(minutes * 12):
        now = NOW + timedelta(seconds=5 * step)
        node = OffloadNode(
            NodeName("a"), NodeInventory(files=(orphan,), reclaims=results), reclaims=requests
        )
        decision = decide_reclaims(node, (), clock, now, GRACE)
        clock = decision.clock
        written += [5.0 * step for _ in decision.requests]
        spec = reclaims_after(node, decision, now)
        if spec is not None:
            requests = tuple(ReclaimRequest.from_spec(entry) for entry in spec)
        # the agent drops results of requests no longer in its spec, answers the new ones
        results = tuple(
            ReclaimResult(request.path, ReclaimOutcome.FAILED, "Permission denied", now)
            for request in requests
        )
    return written


def test_a_reclaim_the_agent_cannot_do_is_asked_again_after_a_doubling_wait() -> None:
    written = _run_sweeps_against_an_agent_that_fails(minutes=30)
    gaps = [later - earlier for earlier, later in itertools.pairwise(written)]
    assert written[0] == 0.0 and len(written) == 5, written  # not every other sweep
    first = RECLAIM_RETRY_FIRST_SECONDS
    # each wait counts from the answer, seen one sweep after the request
    assert [gap - 5 for gap in gaps] == [first, 2 * first, 4 * first, 8 * first]


def test_the_wait_never_exceeds_its_cap() -> None:
    written = _run_sweeps_against_an_agent_that_fails(minutes=24 * 60 // 4)
    assert max(b - a for a, b in itertools.pairwise(written)) == (RECLAIM_RETRY_MAX_SECONDS + 5)


def test_a_done_answer_ends_the_wait() -> None:
    orphan = file(ORPHAN.path, orphaned_since=NOW - timedelta(hours=1))
    failed = agent("a", files=(orphan,), requests=(ORPHAN.path,), results={ORPHAN.path: "Failed"})
    closed = sweep(failed)
    assert ORPHAN.path in closed.clock.retry
    done = agent("a", files=(orphan,), requests=(ORPHAN.path,), results={ORPHAN.path: "Done"})
    assert ORPHAN.path not in sweep(done, closed.clock, at=5).clock.retry
    # and a file held in between forgets it too (its time as an orphan starts again)
    held = sweep(agent("a", files=(file(ORPHAN.path, held=True),)), closed.clock, at=5)
    assert held.clock.retry == {}


def test_an_answer_to_an_earlier_request_does_not_close_a_new_one() -> None:
    orphan = file(ORPHAN.path, orphaned_since=NOW - timedelta(hours=1))
    earlier = ReclaimResult(ORPHAN.path, ReclaimOutcome.DONE, "removed", NOW)
    fresh = ReclaimRequest(ORPHAN.path, 4096, NOW + timedelta(seconds=60), "orphaned")
    node = OffloadNode(
        NodeName("a"), NodeInventory(files=(orphan,), reclaims=(earlier,)), reclaims=(fresh,)
    )
    decision = sweep(node, at=61)
    assert decision.results == ()
    assert reclaims_after(node, decision, NOW + timedelta(seconds=61)) is None  # still pending
    answer = ReclaimResult(ORPHAN.path, ReclaimOutcome.DONE, "removed", NOW + timedelta(seconds=60))
    answered = dataclasses.replace(node, status=NodeInventory(files=(orphan,), reclaims=(answer,)))
    assert [r.time for r in sweep(answered, at=61).results] == [answer.time]


def _said(decision) -> list[tuple[bool, str]]:  # type: ignore[no-untyped-def]
    return [(note.warning, note.reason) for note in announcements(decision)]


def test_a_sweep_announces_what_it_decided_and_a_grace_period_is_not_news() -> None:
    first = sweep(agent("a", files=(ORPHAN,)))
    assert first.refusals and _said(first) == []  # only Refusal.GRACE: counted, not posted
    due = sweep(agent("a", files=(ORPHAN,)), first.clock, at=GRACE)
    [note] = announcements(due)
    assert (note.warning, note.reason) == (False, EventReason.RECLAIM_REQUESTED)
    assert ORPHAN.path in note.message and "8192 bytes" in note.message
    held = file(ORPHAN.path, held=True)
    assert _said(sweep(agent("a", files=(held,)))) == [(False, EventReason.RECLAIM_NOT_REQUESTED)]
    withdrawn = sweep(agent("a", files=(held,), requests=(ORPHAN.path,)))
    assert (True, EventReason.RECLAIM_WITHDRAWN) in _said(withdrawn)
    dry = sweep(agent("a", files=(ORPHAN,)), first.clock, at=GRACE, dry_run=True)
    assert _said(dry) == [(False, EventReason.WOULD_RECLAIM)]


def test_the_agents_answers_are_announced_done_or_not() -> None:
    done = sweep(agent("a", requests=(ORPHAN.path,), results={ORPHAN.path: "Done"}))
    assert _said(done) == [(False, EventReason.RECLAIM_COMPLETED)]
    failed = sweep(agent("a", requests=(ORPHAN.path,), results={ORPHAN.path: "Failed"}))
    [note] = announcements(failed)
    assert (note.warning, note.reason) == (True, EventReason.RECLAIM_NOT_DONE)
    assert note.message.startswith(f"the agent did not reclaim {ORPHAN.path}: failed")


def test_a_decision_is_counted_by_kind_and_refusal_reason() -> None:
    def counts() -> tuple[float, float, float, float]:
        refused = "kvshm_operator_decisions_refused_total"
        return (
            metrics.sample("kvshm_operator_reclaims_requested_total"),
            metrics.sample(refused, {"reason": "held"}),
            metrics.sample(refused, {"reason": "grace"}),
            metrics.sample("kvshm_operator_reclaims_completed_total"),
        )

    before = counts()
    first = sweep(agent("a", files=(ORPHAN,)))  # grace
    metrics.count_reclaim_decision(first)
    metrics.count_reclaim_decision(sweep(agent("a", files=(ORPHAN,)), first.clock, at=GRACE))
    held = file(ORPHAN.path, held=True)
    metrics.count_reclaim_decision(sweep(agent("a", files=(held,), requests=(ORPHAN.path,))))
    answered = agent("a", requests=(ORPHAN.path,), results={ORPHAN.path: "Done"})
    metrics.count_reclaim_decision(sweep(answered))
    after = counts()
    assert [b - a for a, b in zip(before, after, strict=True)] == [1, 1, 1, 1]
