"""The book's writes in time: a status on the way waits for the next report, at most one such
write per resync interval, a settled one goes at once (a fake writer, no API server)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import kopf

from kvshm.operator.announcements import Announcement
from kvshm.operator.book import RegionBook
from kvshm.operator.kube import SpecEdit
from tests.operator.builders import FINALIZER, cluster, region_body
from tests.operator.harness import TEST_CONFIG

CONFIG = dataclasses.replace(TEST_CONFIG, progress_write_seconds=0.05, region_resync_seconds=30)


class FakeWriter:
    """Answers each write with the region as the server would hold it."""

    def __init__(self, region: dict[str, Any]) -> None:
        self.region = region
        self.writes: list[str] = []

    async def json_patch(
        self, plural: str, namespace: str | None, name: str, ops: Sequence[Mapping[str, Any]]
    ) -> dict[str, Any] | None:
        self.writes.append("finalizer")
        meta = {**self.region["metadata"], "finalizers": [FINALIZER]}
        self.region = {**self.region, "metadata": meta}
        return self.region

    async def patch_region_status(
        self, namespace: str, name: str, status: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        self.writes.append(str(status.get("phase")))
        self.region = {**self.region, "status": {**self.region["status"], **status}}
        return self.region

    async def edit_offload_node_spec(self, name: str, edit: SpecEdit) -> bool:
        return True

    async def delete_offload_node(self, name: str) -> bool:
        return True


def report(writer: FakeWriter, phase: str, version: int) -> dict[str, Any]:
    """The region with node a's report, as its next event shows it."""
    status = {**writer.region["status"], "nodes": {"a": {"phase": phase, "observedGeneration": 1}}}
    meta = {**writer.region["metadata"], "resourceVersion": str(version)}
    return {**writer.region, "metadata": meta, "status": status}


async def _run() -> tuple[list[str], list[str]]:
    writer = FakeWriter(
        {**region_body(), "metadata": {**region_body()["metadata"], "resourceVersion": "1"}}
    )
    posted: list[str] = []

    def post(region: kopf.Body, note: Announcement) -> None:
        posted.append(note.reason)

    book = RegionBook(CONFIG, writer, lambda: cluster(["a"]), FINALIZER, post)
    book.mark(book.observe(writer.region))
    await asyncio.sleep(0.3)  # no agent yet: the finalizer, then Pending once the wait is over
    book.mark(book.observe(report(writer, "Creating", 10)))
    await asyncio.sleep(0.3)  # Provisioning waits: a status on the way was written just now
    book.mark(book.observe(report(writer, "Ready", 20)))
    await asyncio.sleep(0.3)
    await book.stop()
    return writer.writes, posted


def test_a_slow_agent_costs_one_status_on_the_way_and_ready_goes_at_once() -> None:
    writes, posted = asyncio.run(_run())
    assert writes == ["finalizer", "Pending", "Ready"]
    assert posted == ["Ready"]
