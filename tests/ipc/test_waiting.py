from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import replace

import pytest

from kvshm.ipc.errors import RingConfigError, RingTimeout, WaitCancelled
from kvshm.ipc.waiting import Waiter, WaitPolicy
from tests.ipc.procs import QUICK

FAST = replace(QUICK, spin_seconds=0.0, min_sleep_seconds=0.001, warn_interval_seconds=0.05)


def wait_forever(waiter: Waiter) -> None:
    while True:
        waiter.pause()


def test_timeout_raises_with_the_description() -> None:
    waiter = Waiter(FAST, lambda: "reader 3 waiting for chunk 7", timeout=0.05)
    started = time.monotonic()
    with pytest.raises(RingTimeout, match="reader 3 waiting for chunk 7") as caught:
        wait_forever(waiter)
    elapsed = time.monotonic() - started
    assert 0.05 <= elapsed < 0.5
    assert isinstance(caught.value, TimeoutError)


def test_zero_timeout_gives_up_on_the_first_pause() -> None:
    with pytest.raises(RingTimeout):
        Waiter(FAST, lambda: "x", timeout=0).pause()


def test_cancel_ends_the_wait_from_another_thread() -> None:
    cancel = threading.Event()
    threading.Timer(0.05, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(WaitCancelled, match="cancelled: waiting for godot"):
        wait_forever(Waiter(FAST, lambda: "waiting for godot", cancel=cancel))
    assert time.monotonic() - started < 1.0


def test_long_waits_warn_periodically(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvshm.ipc.waiting"), pytest.raises(RingTimeout):
        wait_forever(Waiter(FAST, lambda: "writer blocked", timeout=0.3))
    warnings = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert 2 <= len(warnings) <= 6  # one per 0.05 s at most, and more than once
    assert all("writer blocked" in message for message in warnings)


def test_indefinite_waits_do_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvshm.ipc.waiting"), pytest.raises(RingTimeout):
        wait_forever(Waiter(FAST, lambda: "x", timeout=0.15, indefinite=True))
    assert not caplog.records


def test_the_peer_check_runs_periodically_and_can_end_the_wait() -> None:
    calls: list[float] = []

    def check(now: float) -> None:
        calls.append(now)
        if len(calls) == 3:
            raise ConnectionError("peer gone")

    with pytest.raises(ConnectionError, match="peer gone"):
        wait_forever(Waiter(FAST, lambda: "x", timeout=5, check=check))
    gaps = [later - earlier for earlier, later in itertools.pairwise(calls)]
    assert all(gap >= FAST.liveness_interval_seconds for gap in gaps)


def test_sleeps_back_off_to_the_maximum() -> None:
    policy = WaitPolicy(spin_seconds=0, min_sleep_seconds=0.001, max_sleep_seconds=0.008)
    sleeps: list[float] = []
    waiter = Waiter(policy, lambda: "x", park=sleeps.append)
    for _ in range(7):
        waiter.pause()
    assert sleeps == [0.001, 0.002, 0.004, 0.008, 0.008, 0.008, 0.008]


def test_sleeps_never_pass_the_deadline() -> None:
    sleeps: list[float] = []
    policy = WaitPolicy(spin_seconds=0, min_sleep_seconds=5, max_sleep_seconds=5)
    waiter = Waiter(policy, lambda: "x", timeout=0.5, park=sleeps.append)
    waiter.pause()
    assert 0 < sleeps[0] <= 0.5


def test_spinning_first_does_not_sleep() -> None:
    sleeps: list[float] = []
    waiter = Waiter(WaitPolicy(spin_seconds=10), lambda: "x", park=sleeps.append)
    for _ in range(100):
        waiter.pause()  # each yields the CPU instead
    assert sleeps == []


@pytest.mark.parametrize(
    "kwargs",
    [
        {"spin_seconds": -1},
        {"max_sleep_seconds": float("inf")},
        {"min_sleep_seconds": 0.1, "max_sleep_seconds": 0.01},
        {"warn_interval_seconds": 0},
        {"peer_death_grace_seconds": "5"},
    ],
)
def test_bad_policies_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(RingConfigError, match="WaitPolicy"):
        WaitPolicy(**kwargs)  # type: ignore[arg-type]


def test_negative_timeouts_are_refused() -> None:
    with pytest.raises(RingConfigError, match="timeout"):
        Waiter(FAST, lambda: "x", timeout=-1)
