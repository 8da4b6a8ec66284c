"""kvshm.vllm.warm.first_call: the start-up step runs once, before whichever shadowed method is
called first, and every later call finds the class's own method (nothing of the helper left
on its path)."""

from __future__ import annotations

from typing import Any

import pytest

from kvshm.vllm.warm.first_call import FirstCall

METHODS = ("first", "second")


class Owner:
    def __init__(self, ready: list[bool]) -> None:
        self.started: list[str] = []
        self.calls: list[str] = []
        self._ready = ready
        self.first_call = FirstCall(self, METHODS, self._start)

    def _start(self, name: str) -> bool:
        self.started.append(name)
        return self._ready.pop(0)

    def first(self, value: int) -> int:
        self.calls.append("first")
        return value + 1

    def second(self, *, value: int) -> int:
        self.calls.append("second")
        return value * 2


@pytest.mark.parametrize(("name", "call"), [("first", "first"), ("second", "second")])
def test_the_start_runs_once_at_whichever_method_comes_first(name: str, call: str) -> None:
    owner = Owner([True])
    assert owner.first_call.pending
    answer = owner.first(1) if call == "first" else owner.second(value=3)
    assert answer == (2 if call == "first" else 6)
    assert owner.started == [name] and owner.calls == [call]
    assert not owner.first_call.pending
    assert owner.first(5) == 6 and owner.second(value=5) == 10
    assert owner.started == [name]  # never again


def test_later_calls_find_the_class_methods_with_nothing_in_between() -> None:
    owner = Owner([True])
    owner.second(value=1)
    for name in METHODS:
        assert name not in vars(owner)
        bound: Any = getattr(owner, name)
        assert bound.__func__ is getattr(Owner, name)


def test_a_start_that_cannot_run_yet_lets_the_call_through_and_tries_again() -> None:
    owner = Owner([False, True])
    assert owner.second(value=2) == 4  # the class's method ran, not started
    assert owner.first_call.pending and owner.started == ["second"]
    assert owner.first(1) == 2
    assert owner.started == ["second", "first"] and not owner.first_call.pending


class StopsItsFirst(Owner):
    """An owner whose start puts a method of its own in one shadow's place."""

    def _start(self, name: str) -> bool:
        self.started.append(name)
        self.first = self.refuse  # type: ignore[method-assign]
        return True

    def refuse(self, value: int) -> int:
        return -value


def test_a_method_the_start_sets_in_a_shadows_place_stays() -> None:
    owner = StopsItsFirst([])
    assert owner.second(value=2) == 4
    assert owner.first(3) == -3  # what the start put there, for the owner's life
    assert "second" not in vars(owner) and owner.started == ["second"]


def test_a_start_that_raises_stays_armed() -> None:
    owner = Owner([])  # pop from an empty list: the start raises

    with pytest.raises(IndexError):
        owner.first(1)
    assert owner.first_call.pending and owner.calls == []


def test_the_managers_later_calls_are_its_class_methods(shm_dir: Any) -> None:
    from vllm.v1.kv_offload.base import ReqContext

    from kvshm.vllm.warm.manager import FIRST_CALLS, KvshmOffloadingManager, WarmStart

    warm = WarmStart(str(shm_dir), "first", None, off_reason="warm restart off")
    manager = KvshmOffloadingManager(8, warm=warm)
    assert manager.warm_outcome is None and manager._first_call.pending
    manager.lookup(bytes(36), ReqContext(req_id="first"))
    assert manager.warm_outcome is not None and manager.warm_outcome.reason == "warm restart off"
    assert not manager._first_call.pending
    assert not set(FIRST_CALLS) & set(vars(manager))
    manager.shutdown()
