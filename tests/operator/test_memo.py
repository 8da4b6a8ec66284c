"""The operator's memo as kopf uses it: a shallow copy per object shares the parts start-up made
and keeps each object's orphan clock its own; without main()'s config the environment's is read."""

from __future__ import annotations

import copy
from datetime import timedelta

import kopf
import pytest

from kvshm.operator.config import ENV_PREFIX, OperatorConfig
from kvshm.operator.memo import OperatorMemo, operator_config, orphan_clock
from kvshm.operator.orphans import OrphanClock
from tests.operator.builders import NOW


def test_each_objects_copy_shares_the_parts_and_keeps_its_own_orphan_clock() -> None:
    operator = OperatorMemo(config=OperatorConfig(), writer=object())
    node_a, node_b = copy.copy(operator), copy.copy(operator)  # as kopf makes them
    assert node_a.writer is node_b.writer is operator.writer
    assert orphan_clock(node_a) == OrphanClock()
    node_a.orphan_clock = OrphanClock(since={"x": NOW - timedelta(seconds=5)})
    assert orphan_clock(node_b) == OrphanClock()
    assert "orphan_clock" not in operator


def test_without_mains_config_the_environments_is_read_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(f"{ENV_PREFIX}ORPHAN_GRACE_SECONDS", "123")
    memo = OperatorMemo()
    config = operator_config(memo)
    assert config.orphan_grace_seconds == 123
    monkeypatch.setenv(f"{ENV_PREFIX}ORPHAN_GRACE_SECONDS", "456")
    assert operator_config(memo) is config
    given = OperatorConfig()
    assert operator_config(OperatorMemo(config=given)) is given


def test_the_helpers_read_kopfs_own_memo_as_kopf_run_hands_it() -> None:
    plain = kopf.Memo(config=OperatorConfig())  # `kopf run -m kvshm.operator.kopf_run`'s memo
    assert operator_config(plain) is plain.config  # type: ignore[arg-type]
    assert orphan_clock(plain) == OrphanClock()  # type: ignore[arg-type]
