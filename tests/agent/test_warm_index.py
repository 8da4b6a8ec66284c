"""The agent and a region's warm-restart index (vllm_offload_<id>.index, docs/warm-restart.md):
part of its region, never a stray file. It survives an agent restart as the region does, goes
with the region on a drain, a delete and an orphan reclaim, and a tenant's symlink or FIFO at
its name is never followed. A Ready region's status says what the last engine made of it
(status.nodes.<node>.warmIndex), whatever the tenant wrote there."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

from kvshm.agent.warmindex import warm_index_report
from kvshm.api import NodeRegionPhase, ReclaimOutcome, WarmIndexReport, WarmIndexState
from kvshm.region.index.format import HEADER_BYTES, Outcome
from kvshm.region.index.reader import IndexReading
from kvshm.region.index.writer import RegionIndex
from kvshm.region.naming import index_file_name, parse_index_file_name, parse_region_file_name
from tests.agent.builders import make_reconciler, reclaim, region, settle, view
from tests.agent.hostile import (
    RunningAgent,
    tenant,
    tenant_manifest,
    traversable,
    write_regions,
)
from tests.region.index.planting import header, outcome_json, planted_headers

PATH = "ns1/r1/vllm_offload_r1.mmap"
RECORDS = 16


def write_index(root: Path, outcome: Outcome | None = None) -> Path:
    """The index an engine's scheduler writes beside the region (the plugin's kind of file)."""
    with RegionIndex.open(str(root / "ns1" / "r1"), "r1", RECORDS) as index:
        index.adopt({"test": "identity"})
        index.commit(3, b"k" * 36, (1, 0))
        if outcome is not None:
            index.write_outcome(outcome)
    return root / "ns1" / "r1" / index_file_name("r1")


def test_the_index_name_is_its_regions_and_no_region_file() -> None:
    assert parse_index_file_name("vllm_offload_r1.index") == "r1"
    assert parse_region_file_name("vllm_offload_r1.index") is None
    for other in ("vllm_offload_.index", "vllm_offload_../x.index", "vllm_offload_r1.mmap"):
        assert parse_index_file_name(other) is None


def test_an_agent_restart_leaves_the_index_as_it_leaves_the_region(shm_dir: Path) -> None:
    root = shm_dir / "root"
    r1 = region()
    settle(make_reconciler(root), view(r1))
    index = write_index(root)
    before = index.read_bytes()
    result = settle(make_reconciler(root), view(r1))  # a new agent process
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.READY
    assert index.read_bytes() == before
    scan = result.root_scan
    assert scan is not None and [f.path for f in scan.inventory.files] == [PATH]  # no stray


def test_a_drain_removes_the_index_with_the_region(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    settle(reconciler, view(region()))
    write_index(root)
    result = settle(reconciler, view(region(placement={"nodeNames": ["node-b"]})))
    assert result.reports["ns1/r1"].phase is NodeRegionPhase.REMOVED
    assert not (root / "ns1").exists()  # the region, its index and both directories


def test_a_delete_removes_the_index_and_retain_keeps_it(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    settle(reconciler, view(region()))
    write_index(root)
    settle(reconciler, view(region(), deleting=("ns1/r1",)))
    assert not (root / "ns1").exists()
    kept = region(reclaimPolicy="Retain")
    settle(reconciler, view(kept))
    index = write_index(root)
    settle(reconciler, view(kept, deleting=("ns1/r1",)))
    assert index.exists() and (root / PATH).exists()


def test_an_orphan_reclaim_removes_its_index(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    kept = region(reclaimPolicy="Retain")
    settle(reconciler, view(kept))
    write_index(root)
    settle(reconciler, view(kept, deleting=("ns1/r1",)))
    reclaimer = make_reconciler(root)
    scan = reclaimer.reconcile(view()).root_scan
    assert scan is not None and [f.path for f in scan.inventory.orphans] == [PATH]
    result = reclaimer.reconcile(view(reclaims=(reclaim(PATH, 1),)))
    assert result.reclaims[PATH].outcome is ReclaimOutcome.DONE
    assert not (root / "ns1").exists()


def test_a_tenants_symlink_or_fifo_at_the_index_name_is_never_followed(shm_dir: Path) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    settle(reconciler, view(region()))
    target = shm_dir / "target"
    target.write_bytes(b"keep")
    link = root / "ns1" / "r1" / index_file_name("r1")
    link.symlink_to(target)
    result = settle(reconciler, view(region(placement={"nodeNames": ["node-b"]})))
    report = result.reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.REMOVED
    assert "symbolic link" in report.message
    assert target.read_bytes() == b"keep" and os.path.islink(link)


def test_a_ready_regions_status_says_what_the_last_engine_made_of_its_index(
    shm_dir: Path,
) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    first = settle(reconciler, view(region())).reports["ns1/r1"]
    assert first.phase is NodeRegionPhase.READY
    assert first.warm_index == WarmIndexReport(WarmIndexState.ABSENT)
    write_index(root, Outcome("warm", "", 12, 1_764_000_000.4))
    warm = settle(reconciler, view(region())).reports["ns1/r1"].warm_index
    assert warm is not None and warm.state is WarmIndexState.WARM and warm.chunks == 12
    assert warm.started is not None and warm.started.timestamp() == 1_764_000_000
    why = "it was written for another identity: model.name: 'a' -> 'b'"
    write_index(root, Outcome("cold", why, 0, 1_764_000_100.0))
    cold = settle(reconciler, view(region())).reports["ns1/r1"].warm_index
    assert cold == WarmIndexReport(WarmIndexState.COLD, why, 0, cold.started)
    status = settle(reconciler, view(region())).reports["ns1/r1"].to_status()
    assert status["warmIndex"]["state"] == "Cold" and status["warmIndex"]["reason"] == why


def test_a_tenants_damaged_or_planted_index_is_reported_unreadable_never_trusted(
    shm_dir: Path,
) -> None:
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    settle(reconciler, view(region()))
    index = write_index(root, Outcome("warm", "", 3, 1.0))
    data = bytearray(index.read_bytes())
    data[130] ^= 0xFF  # the outcome's check fails
    index.write_bytes(bytes(data))
    report = settle(reconciler, view(region())).reports["ns1/r1"]
    assert report.phase is NodeRegionPhase.READY  # the region itself is untouched
    assert report.warm_index is not None
    assert report.warm_index.state is WarmIndexState.UNREADABLE
    index.unlink()
    os.mkfifo(index)  # a reader that opened it would block forever
    fifo = settle(reconciler, view(region())).reports["ns1/r1"].warm_index
    assert fifo is not None and fifo.state is WarmIndexState.UNREADABLE
    assert "FIFO" in fifo.reason
    index.unlink()
    index.write_bytes(b"\0" * (HEADER_BYTES // 2))  # shorter than a header
    short = settle(reconciler, view(region())).reports["ns1/r1"].warm_index
    assert short is not None and short.state is WarmIndexState.UNREADABLE


def test_an_outcome_is_bounded_before_it_reaches_the_status() -> None:
    huge = IndexReading(True, Outcome("warm", "x" * 10_000, 1 << 70, float("inf")))
    report = warm_index_report(huge)
    assert report.chunks == (1 << 63) - 1 and report.started is None
    assert len(report.reason) <= 4096
    assert warm_index_report(IndexReading(True, Outcome("cold", "", 0, -5.0))).started is None
    assert warm_index_report(IndexReading(False)).state is WarmIndexState.ABSENT


def test_every_planted_index_fails_only_its_own_warm_index_never_the_pass(
    shm_dir: Path,
) -> None:
    """The fuzzer's headers, each in turn in one tenant's directory: every pass publishes, a
    region of another tenant made meanwhile gets Ready, and each status is writable (UTF-8
    JSON of the schema's types)."""
    root = shm_dir / "root"
    reconciler = make_reconciler(root)
    planted, other = region(), region("r2", "ns2")
    settle(reconciler, view(planted))
    index = root / "ns1" / "r1" / index_file_name("r1")
    for number, (name, planted_bytes) in enumerate(planted_headers(mutations=150)):
        index.write_bytes(planted_bytes + bytes(RECORDS * 80))
        later = region(f"later{number}", "ns2") if number % 25 == 0 else None
        regions = (planted, other) + ((later,) if later is not None else ())
        result = settle(reconciler, view(*regions))
        reports = result.reports
        assert reports["ns2/r2"].phase is NodeRegionPhase.READY, name
        if later is not None:
            assert reports[later.key].phase is NodeRegionPhase.READY, name
        report = reports["ns1/r1"]
        assert report.phase is NodeRegionPhase.READY and report.warm_index is not None, name
        status = report.to_status()["warmIndex"]
        json.dumps(status, ensure_ascii=False).encode()  # a lone surrogate would raise here
        assert type(status["chunks"]) is int and 0 <= status["chunks"] < 1 << 63, name
        assert status["reason"].isprintable() and len(status["reason"]) <= 4096, name


_PLANT = """
import sys
path, data = sys.argv[1], bytes.fromhex(sys.argv[2])
open(path, "wb").write(data + bytes(16 * 80))
"""


def test_a_hostile_tenants_index_leaves_the_agent_live_and_publishing(shm_dir: Path) -> None:
    """A real agent, a real unprivileged tenant planting the two headers that once failed
    every pass (a 1,500-deep identity, an outcome time past the largest float): passes go on,
    /healthz stays 200, and another tenant's new region gets Ready."""
    regions = traversable(shm_dir) / "regions"
    regions.mkdir()
    write_regions(regions, "planter.yaml", tenant_manifest("planter"))
    with RunningAgent(regions, shm_dir / "root", "--port", "0") as agent:
        agent.saw("tenant/planter  Ready")
        index = shm_dir / "root" / "tenant" / "planter" / index_file_name("planter")
        deep = header(b"[" * 1500 + b"]" * 1500, outcome_json())
        late = header(outcome=outcome_json(at=10**320))
        for other, planted in (("other1", deep), ("other2", late)):
            tenant(_PLANT, str(index), planted.hex())
            time.sleep(1)  # five passes over the planted file
            write_regions(regions, f"{other}.yaml", tenant_manifest(other))
            agent.saw(f"tenant/{other}  Ready")
            with urllib.request.urlopen(agent.url + "/healthz", timeout=5) as reply:
                assert reply.status == 200
        assert "pass failed" not in agent.output()
