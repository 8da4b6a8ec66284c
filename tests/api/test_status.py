"""The status contract: each record survives its own JSON, and reading what a server may hold
is lenient, safe and bounded."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from kvshm.api import (
    HugePages,
    InventoryFile,
    NodeInventory,
    NodeRegionPhase,
    NodeReport,
    ReclaimOutcome,
    ReclaimRequest,
    ReclaimResult,
    RetainedFile,
    RootPages,
    WarmIndexReport,
    WarmIndexState,
    parse_node_reports,
    parse_offload_node,
)
from kvshm.api.messages import MAX_STATUS_MESSAGE
from kvshm.api.reading import MAX_INVENTORY_FILES, parse_timestamp
from kvshm.region import RegionLayout
from tests.api.admission import CRD_DOCUMENTS

MOMENT = datetime(2026, 11, 22, 12, 0, 0, 654321, tzinfo=UTC)


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
            "Not_A_Node": {"phase": "Ready"},
        }
    }
    parsed = parse_node_reports(status)
    assert parsed["a"].phase is NodeRegionPhase.READY and parsed["a"].locked
    assert parsed["a"].observed_generation == 3 and parsed["a"].ready_for(3)
    assert not parsed["a"].ready_for(4)
    assert parsed["b"].phase is None and parsed["b"].holds_files
    assert set(parsed) == {"a", "b"}
    assert parse_node_reports(None) == {}


def test_a_report_without_a_generation_is_never_ready() -> None:
    unsaid = NodeReport.from_status({"phase": "Ready"})
    assert unsaid.observed_generation == 0 and not unsaid.ready_for(1)


def test_every_record_reads_back_equal_from_its_own_json() -> None:
    report = NodeReport(
        NodeRegionPhase.READY,
        path="/dev/shm/kvshm/t/r/vllm_offload_r.mmap",
        size_bytes=3 << 30,
        populated_bytes=3 << 30,
        locked=True,
        populate_seconds=1.23456,
        holders=2,
        message="x" * (MAX_STATUS_MESSAGE + 10),
        observed_generation=4,
        files=3,
        last_transition_time=MOMENT,
        warm_index=WarmIndexReport(WarmIndexState.WARM, "2 damaged records discarded", 7, MOMENT),
    )
    assert NodeReport.from_status(report.to_status()) == report
    assert len(report.message) == MAX_STATUS_MESSAGE and report.populate_seconds == 1.235
    orphan = InventoryFile("t/r/f", 10, "", False, 12.7, MOMENT, 2)
    claimed = InventoryFile("t/s/g", 20, "t/s", True)
    results = (ReclaimResult("t/q/h", ReclaimOutcome.REFUSED_HELD, "pid 7", MOMENT),)
    inventory = NodeInventory(100, 40, 8, (orphan, claimed), results, MOMENT, "1.2.3")
    assert NodeInventory.from_status(inventory.to_status()) == inventory
    assert inventory.orphans == (orphan,)
    request = ReclaimRequest("t/r/f", 10, MOMENT, "orphaned")
    assert ReclaimRequest.from_spec(request.to_spec()) == request
    retained = RetainedFile("t/r/f", "t/r", MOMENT)
    assert RetainedFile.from_spec(retained.to_spec()) == retained


def test_records_keep_times_to_the_second_as_status_does() -> None:
    file = InventoryFile("t/r/f", 1, "", False, orphaned_since=MOMENT)
    assert file.orphaned_since == MOMENT.replace(microsecond=0)
    assert file.to_status()["orphanedSince"] == "2026-11-22T12:00:00Z"


def test_a_reclaim_request_written_again_has_a_new_token() -> None:
    first = ReclaimRequest("t/r/f", 10, MOMENT, "orphaned")
    again = ReclaimRequest("t/r/f", 10, MOMENT + timedelta(minutes=5), "orphaned")
    assert first.token != again.token
    assert first.token == ReclaimRequest.from_spec(first.to_spec()).token


def test_an_offload_node_reads_the_crd_list_maps() -> None:
    body = {
        "metadata": {"name": "n1"},
        "spec": {
            "reclaims": [{"path": "t/r/f", "sizeBytes": 1}, {"sizeBytes": 2}],
            "retained": [{"path": "t/k/f", "region": "t/k"}],
        },
        "status": {
            "heartbeat": "2026-11-22T12:00:00Z",
            "capacityBytes": 100,
            "freeBytes": 40,
            "files": [
                {"path": "t/r/f", "sizeBytes": 7, "claimedBy": "", "held": False},
                {"path": "t/s/g", "sizeBytes": 9, "claimedBy": "t/s"},
                {"sizeBytes": 1},
                {"path": "t/r/f", "sizeBytes": 99, "held": False},
            ],
            "reclaims": [{"path": "t/r/f", "outcome": "RefusedHeld", "message": "pid 7"}],
        },
    }
    node = parse_offload_node(body)
    assert node is not None and node.name == "n1"
    inventory = node.status
    assert inventory.heartbeat == datetime(2026, 11, 22, 12, tzinfo=UTC)
    assert (inventory.capacity_bytes, inventory.free_bytes) == (100, 40)
    # a file whose held is not said counts as held; a path listed twice is read once
    assert [(f.path, f.held, f.size_bytes) for f in inventory.files] == [
        ("t/r/f", False, 7),
        ("t/s/g", True, 9),
    ]
    assert [r.path for r in node.reclaims] == ["t/r/f"]
    assert node.retained_file("t/k/f") == RetainedFile("t/k/f", "t/k")
    assert inventory.reclaims[0].outcome is ReclaimOutcome.REFUSED_HELD


def test_an_offload_node_of_an_agent_that_has_not_reported() -> None:
    node = parse_offload_node({"metadata": {"name": "n1"}})
    assert node is not None
    assert node.status.heartbeat is None and node.status.capacity_bytes is None
    assert node.status.files == () and node.reclaims == ()
    assert parse_offload_node({"metadata": {"name": "Not A Node"}}) is None


def test_reading_is_bounded_by_the_schema() -> None:
    files = [{"path": f"t/r{i}/f", "sizeBytes": 1} for i in range(MAX_INVENTORY_FILES + 5)]
    long_path = {"path": "p" * 5000, "sizeBytes": 1}
    inventory = NodeInventory.from_status({"files": [long_path, *files]})
    assert len(inventory.files) == MAX_INVENTORY_FILES
    assert inventory.files[0].path == "t/r0/f"  # an over-long path is no entry
    negative = NodeInventory.from_status({"capacityBytes": -1, "reserveBytes": True})
    assert negative.capacity_bytes is None and negative.reserve_bytes == 0


def test_outcomes_in_either_spelling_and_unknown_ones_as_failed() -> None:
    outcomes = {
        "Done": "done",
        "done": "done",
        "refused_claimed": "refused_claimed",
        "RefusedClaimed": "refused_claimed",
        "weird": "failed",
    }
    for raw, expected in outcomes.items():
        result = ReclaimResult.from_status({"path": "p", "outcome": raw})
        assert result.outcome.value == expected


def test_timestamps() -> None:
    assert parse_timestamp("2026-11-22T12:00:00.5Z") == datetime(2026, 11, 22, 12, tzinfo=UTC)
    assert parse_timestamp("yesterday") is None
    assert parse_timestamp(None) is None


def test_root_pages_read_back_as_written_and_leniently() -> None:
    pages = RootPages(2 << 20, HugePages.WITHIN_SIZE, rounds_up=False)
    inventory = NodeInventory(1 << 30, 1 << 29, pages=pages)
    assert NodeInventory.from_status(inventory.to_status()) == inventory
    status = inventory.to_status()
    assert status["pages"] == {"sizeBytes": 2 << 20, "huge": "within_size", "roundsUp": False}
    # a setting this reader does not know, and no roundsUp: read as rounding (never too much)
    odd = NodeInventory.from_status({"pages": {"sizeBytes": 2 << 20, "huge": "sometimes"}})
    assert odd.pages == RootPages(2 << 20, HugePages.UNKNOWN, rounds_up=True)
    assert NodeInventory.from_status({"pages": {"sizeBytes": 0}}).pages is None
    assert NodeInventory.from_status({}).pages is None


def test_the_huge_pages_vocabulary_is_the_crds() -> None:
    node_crd = next(c for c in CRD_DOCUMENTS if c["spec"]["names"]["kind"] == "OffloadNode")
    schema = node_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    enum = schema["properties"]["status"]["properties"]["pages"]["properties"]["huge"]["enum"]
    assert enum == [member.value for member in HugePages]


def test_what_a_root_holds_for_a_region_rounds_only_where_the_root_rounds() -> None:
    # 32 files of 1057 rows of 1 MiB, the last of 1026: 31 files end 1 MiB into a huge page
    layout = RegionLayout(33 * 1024 + 1, 1 << 20, 1)
    assert layout.file_count == 32 and layout.rows_per_file == 1057
    rounding = RootPages(2 << 20, HugePages.ALWAYS, rounds_up=True)
    assert rounding.allocation_bytes(layout) == layout.size_bytes + 31 * (1 << 20)
    assert RootPages(2 << 20, HugePages.WITHIN_SIZE).allocation_bytes(layout) == layout.size_bytes
    assert NodeInventory().allocation_bytes(layout) == layout.size_bytes  # not measured yet


def test_a_warm_index_reads_back_as_written_and_leniently() -> None:
    cold = WarmIndexReport(WarmIndexState.COLD, "r" * (MAX_STATUS_MESSAGE + 1), 0, None)
    assert len(cold.reason) == MAX_STATUS_MESSAGE
    written = cold.to_status()
    # every key, null ones too: a merge patch would keep a startedAt an earlier report wrote
    assert set(written) == {"state", "reason", "chunks", "startedAt"}
    assert written["startedAt"] is None and written["state"] == "Cold"
    assert WarmIndexReport.from_status(written) == cold
    odd = WarmIndexReport.from_status({"state": "Lukewarm", "chunks": -3, "reason": 7})
    assert odd == WarmIndexReport(None, "", 0, None)
    assert WarmIndexReport.from_status("warm") is None
    # a report without one writes null (a merge patch then removes an earlier one)
    plain = NodeReport(NodeRegionPhase.DRAINING)
    assert plain.to_status()["warmIndex"] is None
    assert NodeReport.from_status(plain.to_status()).warm_index is None


def test_the_warm_index_vocabulary_is_the_crds() -> None:
    region_crd = next(c for c in CRD_DOCUMENTS if c["spec"]["names"]["kind"] == "OffloadRegion")
    schema = region_crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    node = schema["properties"]["status"]["properties"]["nodes"]["additionalProperties"]
    warm = node["properties"]["warmIndex"]
    assert warm["properties"]["state"]["enum"] == [member.value for member in WarmIndexState]
    assert set(warm["properties"]) == set(WarmIndexReport(WarmIndexState.ABSENT).to_status())
