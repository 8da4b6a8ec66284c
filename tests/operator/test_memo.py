"""The operator's memo as kopf uses it: a shallow copy per object shares the parts start-up made
and keeps each object's orphan clock its own; without main()'s config the environment's is read."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest

from kvshm.operator.config import ENV_PREFIX, OperatorConfig
from kvshm.operator.memo import OperatorMemo
from kvshm.operator.orphans import OrphanClock
from tests.operator.builders import NOW


def test_each_objects_copy_shares_the_parts_and_keeps_its_own_orphan_clock() -> None:
    operator = OperatorMemo(config=OperatorConfig(), writer=object())
    node_a, node_b = copy.copy(operator), copy.copy(operator)  # as kopf makes them
    assert node_a.writer is node_b.writer is operator.writer
    assert node_a.orphan_clock_or_new() == OrphanClock()
    node_a.orphan_clock = OrphanClock(since={"x": NOW - timedelta(seconds=5)})
    assert node_b.orphan_clock_or_new() == OrphanClock()
    assert "orphan_clock" not in operator


def test_without_mains_config_the_environments_is_read_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(f"{ENV_PREFIX}ORPHAN_GRACE_SECONDS", "123")
    memo = OperatorMemo()
    config = memo.operator_config()
    assert config.orphan_grace_seconds == 123
    monkeypatch.setenv(f"{ENV_PREFIX}ORPHAN_GRACE_SECONDS", "456")
    assert memo.operator_config() is config
    given = OperatorConfig()
    assert OperatorMemo(config=given).operator_config() is given
