"""The OffloadNode sweep against the shared cluster snapshot: a retained file's retention is
forgotten, and an OffloadNode deleted, only on a current view (a fake writer, no API server)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

import kopf
import pytest

from kvshm.operator import handlers
from kvshm.operator.cluster import ClusterSnapshot, Snapshots
from kvshm.operator.kube import SpecEdit
from kvshm.operator.memo import OperatorMemo
from tests.operator.builders import agent, cluster, file
from tests.operator.harness import TEST_CONFIG

KEY, PATH = "team/kept", "team/kept/vllm_offload_kept.mmap"


class FakeBook:
    def tick(self) -> None:
        pass


class FakeWriter:
    def __init__(self) -> None:
        self.specs: list[dict[str, Any] | None] = []
        self.deleted: list[str] = []

    async def delete_offload_node(self, name: str) -> bool:
        self.deleted.append(name)
        return True

    async def edit_offload_node_spec(self, name: str, edit: SpecEdit) -> bool:
        self.specs.append(edit({"retained": [{"path": PATH, "region": KEY}]}))
        return True


def _sweep(views: list[ClusterSnapshot]) -> tuple[FakeWriter, int]:
    """Sweep node a, whose spec retains PATH and whose agent lists it unclaimed, with the
    shared snapshot `views[0]` and a fresh one `views[1]`; the writer and snapshots built.
    Events are taken by the `events` fixture."""
    node = agent("a", files=(file(PATH),), retained=(PATH,))
    body = {
        "metadata": {"name": "a"},
        "spec": {"retained": [entry.to_spec() for entry in node.retained]},
        "status": node.status.to_status(),
    }
    built = iter(views)
    writer = FakeWriter()
    memo = OperatorMemo(
        config=TEST_CONFIG,
        book=FakeBook(),
        writer=writer,
        views=Snapshots(lambda: next(built), max_age=60),
    )
    logger = logging.getLogger(__name__)
    asyncio.run(handlers.sweep_node(name="a", body=kopf.Body(body), memo=memo, logger=logger))
    return writer, len(views) - len(list(built))


@pytest.fixture(autouse=True)
def events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The Events the sweep posts, by reason (kopf posts them only inside a running operator)."""
    posted: list[str] = []

    def post(body: kopf.Body, *, reason: str, message: str = "") -> None:
        posted.append(reason)

    monkeypatch.setattr(kopf, "info", post)
    monkeypatch.setattr(kopf, "warn", post)
    return posted


def _view(live: bool) -> ClusterSnapshot:
    view = cluster(["a"], regions={KEY: PATH} if live else {})
    return dataclasses.replace(view, live_regions={KEY: PATH} if live else {})


def test_a_region_released_within_the_snapshots_age_does_not_undo_its_retention(
    events: list[str],
) -> None:
    """The shared view still shows the region live (it was released a moment ago); the
    current one shows it gone: the retention stays, so the file is never reclaimed."""
    writer, built = _sweep([_view(live=True), _view(live=False)])
    assert writer.specs == []  # spec.retained is left as it is
    assert events == []  # nor is the file refused as the file of an existing region
    assert built == 2  # the shared view, then a current one before forgetting anything


def test_a_retained_file_claimed_again_is_forgotten_on_a_current_view(events: list[str]) -> None:
    writer, built = _sweep([_view(live=True), _view(live=True)])
    assert built == 2
    assert writer.specs == [{"retained": []}]
    assert events == ["ReclaimNotRequested"]  # the file of an existing region


def test_a_node_missing_from_the_shared_view_is_looked_up_again_before_its_deletion(
    events: list[str],
) -> None:
    """The shared view was built before the Node (or its agent's heartbeat) was seen, as at an
    operator's start; the current one has it: the OffloadNode stays. Deleting it stopped the
    node's sweep for good (tests/monitoring saw it as an operator that went quiet)."""
    writer, built = _sweep([cluster([], agents=[]), _view(live=False)])
    assert built == 2
    assert writer.deleted == [] and "NodeGone" not in events


def test_a_node_gone_from_the_current_view_too_is_deleted(events: list[str]) -> None:
    writer, built = _sweep([cluster([], agents=[]), cluster([], agents=[])])
    assert built == 2
    assert writer.deleted == ["a"] and events == ["NodeGone"]
