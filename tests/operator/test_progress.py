"""kopf's handler progress by kind: regions' in status, OffloadNodes' in annotations."""

from __future__ import annotations

from typing import Any

import kopf

from kvshm.api import GROUP, NODE_KIND, REGION_KIND, VERSION
from kvshm.operator.progress import ProgressByKind

RECORD: Any = {"started": "2026-01-01T00:00:00", "retries": 1, "delayed": "2026-01-01T00:00:02"}


def body(kind: str, **extra: Any) -> kopf.Body:
    meta = {"name": "r1", "namespace": "ns1"} if kind == REGION_KIND else {"name": "node-a"}
    return kopf.Body({"apiVersion": f"{GROUP}/{VERSION}", "kind": kind, "metadata": meta, **extra})


def test_a_regions_progress_goes_to_status_where_its_author_cannot_write() -> None:
    storage, patch = ProgressByKind(), kopf.Patch()
    storage.store(key="release", record=RECORD, body=body(REGION_KIND), patch=patch)
    storage.touch(body=body(REGION_KIND), patch=patch, value="now")
    assert patch["status"]["kopf"]["progress"]["release"]["retries"] == 1
    assert patch["status"]["kopf"]["dummy"] == "now"
    assert "metadata" not in patch
    # and is read from there only: an annotation an author wrote is not a record
    forged = body(
        REGION_KIND,
        metadata={"name": "r1", "namespace": "ns1", "annotations": {"kvshm.dev/release": "{}"}},
    )
    assert storage.fetch(key="release", body=forged) is None
    stored = body(REGION_KIND, status={"kopf": {"progress": {"release": RECORD}}})
    assert storage.fetch(key="release", body=stored) == RECORD


def test_an_offload_nodes_progress_goes_to_annotations_not_the_agents_status() -> None:
    storage, patch = ProgressByKind(), kopf.Patch()
    storage.touch(body=body(NODE_KIND), patch=patch, value="now")
    assert "status" not in patch
    assert [k for k in patch["metadata"]["annotations"] if k.startswith("kvshm.dev/")]


def test_the_essence_kopf_compares_leaves_out_both_kinds_of_record() -> None:
    essence: Any = {
        "metadata": {"annotations": {"kvshm.dev/sweep": "{}", "team": "a"}},
        "status": {"kopf": {"progress": {"release": RECORD}, "dummy": "x"}, "phase": "Ready"},
    }
    cleared = ProgressByKind().clear(essence=essence)
    assert cleared["metadata"]["annotations"] == {"team": "a"}
    assert cleared["status"].get("kopf", {}).get("progress") is None
    assert cleared["status"]["phase"] == "Ready"
