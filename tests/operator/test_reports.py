"""Reading the agents' reports: safe defaults for anything missing or malformed."""

from __future__ import annotations

from datetime import UTC, datetime

from kvshm.api import NodeRegionPhase, ReclaimOutcome
from kvshm.operator.reports import (
    parse_inventory,
    parse_node_reports,
    parse_timestamp,
    region_file_path,
)


def test_node_reports_parse_known_fields_and_tolerate_unknown_phases() -> None:
    status = {
        "nodes": {
            "a": {
                "phase": "Ready",
                "path": "/dev/shm/kvshm/t/r/f",
                "populatedBytes": 5,
                "locked": True,
                "observedGeneration": 3,
            },
            "b": {"phase": "Exploded"},
            "c": "not an object",
        }
    }
    parsed = parse_node_reports(status)
    assert parsed["a"].phase is NodeRegionPhase.READY and parsed["a"].locked
    assert parsed["a"].observed_generation == 3 and parsed["a"].ready_for(3)
    assert not parsed["a"].ready_for(4)
    assert parsed["b"].phase is None and parsed["b"].holds_files
    assert "c" not in parsed
    assert parse_node_reports(None) == {}


def test_inventory_reads_the_crd_list_maps() -> None:
    body = {
        "metadata": {"name": "n1"},
        "spec": {"reclaims": [{"path": "t/r/f", "sizeBytes": 1}]},
        "status": {
            "heartbeat": "2026-11-22T12:00:00Z",
            "capacityBytes": 100,
            "freeBytes": 40,
            "files": [
                {"path": "t/r/f", "sizeBytes": 7, "claimedBy": "", "held": False},
                {"path": "t/s/g", "sizeBytes": 9, "claimedBy": "t/s"},
                {"sizeBytes": 1},
            ],
            "reclaims": [{"path": "t/r/f", "outcome": "RefusedHeld", "message": "pid 7"}],
        },
    }
    inventory = parse_inventory(body)
    assert inventory.name == "n1"
    assert inventory.heartbeat == datetime(2026, 11, 22, 12, tzinfo=UTC)
    assert (inventory.capacity_bytes, inventory.free_bytes) == (100, 40)
    assert [(f.path, f.held) for f in inventory.files] == [("t/r/f", False), ("t/s/g", True)]
    assert set(inventory.reclaim_requests) == {"t/r/f"}
    assert inventory.reclaim_results[0].outcome is ReclaimOutcome.REFUSED_HELD


def test_inventory_of_an_agent_that_has_not_reported() -> None:
    inventory = parse_inventory({"metadata": {"name": "n1"}})
    assert inventory.heartbeat is None and inventory.capacity_bytes is None
    assert inventory.files == ()


def test_outcomes_in_either_spelling_and_unknown_ones_as_failed() -> None:
    outcomes = {
        "Done": "done",
        "done": "done",
        "refused_claimed": "refused_claimed",
        "RefusedClaimed": "refused_claimed",
        "weird": "failed",
    }
    for raw, expected in outcomes.items():
        body = {"status": {"reclaims": [{"path": "p", "outcome": raw}]}}
        assert parse_inventory(body).reclaim_results[0].outcome.value == expected


def test_timestamps() -> None:
    assert parse_timestamp("2026-11-22T12:00:00.5Z") is not None
    assert parse_timestamp("yesterday") is None
    assert parse_timestamp(None) is None


def test_region_file_path_is_the_agents_relative_path() -> None:
    assert region_file_path("team", "r1", "eng-1") == "team/r1/vllm_offload_eng-1.mmap"
