"""One record per region (kvshm.agent.record): its states, their transitions, and the backoff of
failed attempts, alone and through the reconciler on a real tmpfs with a clock of its own."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvshm.agent.hosting
from kvshm.agent.drain.drainer import Drain
from kvshm.agent.errors import ErrorReason
from kvshm.agent.hosting import HostedRegion, HostingSettings
from kvshm.agent.reconciler import NodeReconciler, ReconcilerSettings
from kvshm.agent.record import Backoff, Failure, RegionRecord, RegionState
from kvshm.agent.reports import EventReason, NodeReport, PassResult
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.root.saferoot import RegionRoot
from kvshm.agent.view import ClusterView
from kvshm.api import NodeRegionPhase, OffloadRegion
from kvshm.region import RegionSpaceError, SharedOffloadRegion
from tests.agent.builders import RecordingNotifier, region, settle, view

# -- backoff ---------------------------------------------------------------------------------


def test_backoff_starts_at_the_first_delay_doubles_and_stops_at_the_most() -> None:
    backoff = Backoff()
    assert not backoff.waiting(0.0)
    delays = []
    now = 100.0
    for _ in range(7):
        backoff = backoff.after_failed_attempt(now, first=30.0, most=600.0)
        delays.append(backoff.delay)
        assert backoff.retry_at == now + backoff.delay
        assert backoff.waiting(now + backoff.delay - 0.001)
        assert not backoff.waiting(now + backoff.delay)
        now = backoff.retry_at
    assert delays == [30.0, 60.0, 120.0, 240.0, 480.0, 600.0, 600.0]


# -- transitions ------------------------------------------------------------------------------


@pytest.fixture
def root(shm_dir: Path) -> RegionRoot:
    return RegionRoot(str(shm_dir / "root"))


def hosted_region(root: RegionRoot, spec: OffloadRegion) -> HostedRegion:
    """A HostedRegion not started (its thread never runs): what the record holds."""
    with root.ensure_region_dir(spec.namespace, spec.name, spec.access) as region_dir:
        return HostedRegion(spec, region_dir, adopt=False, settings=HostingSettings())


def drain_of(spec: OffloadRegion) -> Drain:
    return Drain(spec, "test", deadline_monotonic=0.0, deadline_unix=0.0)


def removed() -> NodeReport:
    return NodeReport(NodeRegionPhase.REMOVED, message="removed")


def failure(spec: OffloadRegion) -> Failure:
    return Failure(spec, ErrorReason.CAPACITY, "no room")


def test_opening_then_ready(root: RegionRoot) -> None:
    record = RegionRecord("ns1/r1")
    assert record.state is RegionState.ABSENT
    record.opening(hosted_region(root, region()))
    assert record.state is RegionState.OPENING and record.claims("r1")
    assert not record.claims("other")
    record.told_ready()
    assert record.state is RegionState.READY and record.ready_told


def test_a_failed_region_stays_failed_while_it_is_opened_again(root: RegionRoot) -> None:
    spec = region()
    record = RegionRecord(spec.key)
    record.failed(failure(spec))
    assert record.state is RegionState.FAILED
    record.opening(hosted_region(root, spec))
    assert record.state is RegionState.FAILED  # until the retry is taken in
    record.recovered()
    assert record.state is RegionState.OPENING
    record.told_ready()
    assert record.state is RegionState.READY


def test_a_refused_spec_change_keeps_the_ready_region(root: RegionRoot) -> None:
    spec = region()
    record = RegionRecord(spec.key)
    record.opening(hosted_region(root, spec))
    record.told_ready()
    record.failed(failure(spec))
    assert record.state is RegionState.FAILED and record.hosted is not None
    record.told_ready()  # told already: stays Failed while the failure lasts
    assert record.state is RegionState.FAILED
    record.recovered()
    assert record.state is RegionState.READY


def test_a_failed_attempt_lets_go_of_the_files(root: RegionRoot) -> None:
    spec = region()
    record = RegionRecord(spec.key)
    record.opening(hosted_region(root, spec))
    record.attempt_failed(failure(spec))
    assert record.state is RegionState.FAILED and record.hosted is None
    assert not record.claims("r1")


def test_lost_files_leave_nothing_held(root: RegionRoot) -> None:
    spec = region()
    record = RegionRecord(spec.key)
    hosted = hosted_region(root, spec)
    record.opening(hosted)
    record.told_ready()
    assert record.files_lost() is hosted
    assert record.state is RegionState.ABSENT and not record.ready_told


def test_draining_then_removed_and_forgotten(root: RegionRoot) -> None:
    spec = region()
    record = RegionRecord(spec.key)
    record.opening(hosted_region(root, spec))
    record.told_ready()
    record.draining(drain_of(spec))
    assert record.state is RegionState.DRAINING
    assert record.hosted is None and record.claims("r1") and not record.ready_told
    report = removed()
    record.drained("r1", report)
    assert record.state is RegionState.REMOVED and record.removed is report
    record.forget_removed()
    assert record.state is RegionState.ABSENT and record.removed is None


def test_a_new_instance_opens_beside_the_drain_of_the_old(root: RegionRoot) -> None:
    old, new = region(), region(instanceId="r1-new")
    record = RegionRecord(old.key)
    record.draining(drain_of(old))
    record.opening(hosted_region(root, new))
    assert record.state is RegionState.OPENING
    assert record.claims("r1") and record.claims("r1-new")
    record.drained("r1", removed())
    assert record.state is RegionState.OPENING  # the new instance's report stands


def test_removed_only_once_the_last_drain_is_done() -> None:
    first, second = region(), region(instanceId="r1-b")
    record = RegionRecord(first.key)
    record.draining(drain_of(first))
    record.draining(drain_of(second))
    record.drained("r1", removed())
    assert record.state is RegionState.DRAINING
    record.drained("r1-b", removed())
    assert record.state is RegionState.REMOVED


def test_giving_up_on_a_failed_region() -> None:
    spec = region()
    record = RegionRecord(spec.key)
    record.failed(failure(spec))
    assert record.give_up() is spec
    assert record.state is RegionState.ABSENT and record.failure is None
    record.note_removed(removed())
    assert record.state is RegionState.REMOVED


def test_the_report_follows_the_state(root: RegionRoot) -> None:
    spec = region()
    holds = HoldChecker()
    record = RegionRecord(spec.key)

    def path(r: OffloadRegion) -> str:
        return f"/root/{r.key}"

    def phase() -> NodeRegionPhase | None:
        report = record.report(holds, path)
        return None if report is None else report.phase

    assert phase() is None
    record.opening(hosted_region(root, spec))
    assert phase() is NodeRegionPhase.PENDING  # the hosted region's own phase
    record.failed(failure(spec))
    assert phase() is NodeRegionPhase.FAILED
    record.draining(drain_of(spec))
    assert phase() is NodeRegionPhase.DRAINING
    record.drained("r1", removed())
    assert phase() is NodeRegionPhase.REMOVED


# -- backoff through the reconciler -----------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FailingOpens:
    """Makes the agent's opening of region files fail (a full tmpfs) while `failing` is set."""

    def __init__(self) -> None:
        self.failing = True
        self.attempts = 0

    def __call__(self, *args: Any, **kwargs: Any) -> SharedOffloadRegion:
        self.attempts += 1
        if self.failing:
            raise RegionSpaceError("region", 1, 0, "injected by the test")
        return SharedOffloadRegion(*args, **kwargs)


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> FailingOpens:
    fake = FailingOpens()
    monkeypatch.setattr(kvshm.agent.hosting, "SharedOffloadRegion", fake)
    return fake


def settle_telling(
    reconciler: NodeReconciler, cluster: ClusterView
) -> tuple[PassResult, list[EventReason]]:
    """settle(), with the events of every pass it took."""
    told: list[EventReason] = []
    result = reconciler.reconcile(cluster)
    for _ in range(50):
        told += [event.reason for event in result.events]
        if result.settled:
            return result, told
        reconciler.wait_idle(10)
        result = reconciler.reconcile(cluster)
    raise AssertionError(f"not settled: {result.reports}")


def reconciler_with(root: Path, clock: Callable[[], float]) -> NodeReconciler:
    settings = ReconcilerSettings(
        retry_seconds=30.0, max_retry_seconds=100.0, hosting=HostingSettings(2)
    )
    return NodeReconciler(RegionRoot(str(root)), RecordingNotifier(), settings, clock=clock)


def test_failed_attempts_are_retried_after_a_doubling_delay(
    shm_dir: Path, opens: FailingOpens
) -> None:
    clock = Clock()
    reconciler = reconciler_with(shm_dir / "root", clock)
    spec = region()
    cluster = view(spec)
    result, told = settle_telling(reconciler, cluster)
    assert result.reports[spec.key].phase is NodeRegionPhase.FAILED
    assert "injected by the test" in result.reports[spec.key].message
    assert opens.attempts == 1
    assert told == [EventReason.CREATED, EventReason.FAILED]
    failed_at = clock.now
    for delay in (30.0, 60.0, 100.0, 100.0):  # doubled, then at most max_retry_seconds
        record = reconciler.records()[spec.key]
        assert record.state is RegionState.FAILED and record.failure is not None
        assert record.failure.backoff == Backoff(delay, failed_at + delay)
        attempts = opens.attempts
        clock.now = failed_at + delay - 1
        assert settle(reconciler, cluster).reports[spec.key].phase is NodeRegionPhase.FAILED
        assert opens.attempts == attempts  # not yet
        clock.now = failed_at = failed_at + delay
        result, told = settle_telling(reconciler, cluster)
        assert opens.attempts == attempts + 1
        assert result.reports[spec.key].phase is NodeRegionPhase.FAILED
        assert told == [EventReason.CREATED]  # the same failure again is not told again

    opens.failing = False
    clock.now += 100
    result, told = settle_telling(reconciler, cluster)
    assert result.reports[spec.key].phase is NodeRegionPhase.READY
    assert told == [EventReason.CREATED, EventReason.READY]
    record = reconciler.records()[spec.key]
    assert record.state is RegionState.READY and record.failure is None


def test_a_changed_spec_is_tried_at_once_and_starts_its_own_backoff(
    shm_dir: Path, opens: FailingOpens
) -> None:
    clock = Clock()
    reconciler = reconciler_with(shm_dir / "root", clock)
    settle(reconciler, view(region()))
    settle(reconciler, view(region()))
    assert opens.attempts == 1
    changed = region(lock=False)
    settle(reconciler, view(changed))
    assert opens.attempts == 2  # no wait: the spec that failed is not this one
    failure = reconciler.records()[changed.key].failure
    assert failure is not None and failure.region == changed
    assert failure.backoff == Backoff(30.0, clock.now + 30.0)


def test_a_failed_region_no_longer_wanted_is_removed(shm_dir: Path, opens: FailingOpens) -> None:
    reconciler = reconciler_with(shm_dir / "root", Clock())
    spec = region()
    settle(reconciler, view(spec))
    gone = settle(reconciler, view(spec, deleting=(spec.key,)))
    assert gone.reports[spec.key].phase is NodeRegionPhase.REMOVED
    assert reconciler.records()[spec.key].state is RegionState.REMOVED
    assert not (shm_dir / "root" / spec.key).exists()
    settle(reconciler, view())
    assert reconciler.records() == {}


def test_a_failure_is_news_once_per_reason_and_spec_and_keeps_its_specs_backoff() -> None:
    spec = region()
    first = Failure(spec, ErrorReason.CAPACITY, "no room").after_failed_attempt(100.0, 30, 600)
    again = Failure(spec, ErrorReason.CAPACITY, "no room").follows(first)
    assert first.is_news_after(None) and not again.is_news_after(first)
    assert again.backoff == first.backoff == Backoff(30.0, 130.0)
    other_reason = Failure(spec, ErrorReason.IO, "EIO").follows(first)
    assert other_reason.is_news_after(first) and other_reason.backoff == first.backoff
    new_spec = Failure(region(blocks=32), ErrorReason.CAPACITY, "no room").follows(first)
    assert new_spec.is_news_after(first) and new_spec.backoff == Backoff()


def test_a_permission_failure_says_which_capabilities_the_agent_lacks() -> None:
    failure = Failure.of(region(), ErrorReason.PERMISSION, "cannot open")
    assert f"uid {os.geteuid()}" in failure.message and "CAP_DAC_OVERRIDE" in failure.message
    told = Failure.of(region(), ErrorReason.PERMISSION, "drop the capabilities list")
    assert told.message == "drop the capabilities list"
    assert Failure.of(region(), ErrorReason.IO, "EIO").message == "EIO"
