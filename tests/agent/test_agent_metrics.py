"""/metrics, /healthz and /readyz: every agent metric of docs/metrics.md, with real values."""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvshm.agent.drain.drainer import DrainOutcome
from kvshm.agent.metrics import AgentMetrics
from kvshm.agent.reconciler import NodeReconciler, ReconcilerSettings
from kvshm.agent.root.saferoot import RegionRoot
from kvshm.agent.server import Health, serve
from tests.agent.builders import RecordingNotifier, reclaim, region, region_dir, settle, view
from tests.agent.cluster import REPO

CONTRACT = REPO / "docs" / "metrics.md"
FORBIDDEN_LABELS = {"instance", "job", "namespace", "pod", "node"}


def contract() -> dict[str, str]:
    """name -> type of every row of the agent section of docs/metrics.md."""
    section = CONTRACT.read_text().split("## Agent", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| (kvshm_agent_\w+) \| (\w+)", section, re.MULTILINE)
    return dict(rows)


@pytest.fixture
def scraped(shm_dir: Path) -> Iterator[tuple[str, str]]:
    """A reconciler that made one ready region, one failed one, one orphan, one reclaim and
    one drain, with its metrics served; yields (metrics text, base url)."""
    root = shm_dir / "root"
    (region_dir(root, "ns1/orphan") / "vllm_offload_orphan.mmap").write_bytes(b"\0" * 8192)
    (region_dir(root, "ns1/bad") / "vllm_offload_bad.mmap").write_bytes(b"\0" * 100)
    metrics = AgentMetrics("1.2.3")
    reconciler = NodeReconciler(
        RegionRoot(str(root)), RecordingNotifier(), ReconcilerSettings(), counters=metrics
    )
    gone = region("gone")
    settle(reconciler, view(region("ok"), region("bad"), gone))
    settle(reconciler, view(region("ok"), region("bad")))  # "gone" drained
    result = reconciler.reconcile(
        view(
            region("ok"),
            region("bad"),
            reclaims=(reclaim("ns1/missing/vllm_offload_missing.mmap"),),
        )
    )
    metrics.observe(result)
    metrics.watch_restarted()
    health = Health(stale_after_seconds=60)
    server = serve("127.0.0.1", 0, metrics.registry, health)
    base = f"http://127.0.0.1:{server.server_port}"
    health.passed()
    try:
        yield urllib.request.urlopen(base + "/metrics", timeout=5).read().decode(), base
    finally:
        server.shutdown()
        server.server_close()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_every_contract_metric_is_served_with_its_type(scraped: tuple[str, str]) -> None:
    text, _ = scraped
    assert len(contract()) >= 19  # the table was read
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE))
    for name, kind in contract().items():
        served = types.get(name) or types.get(name.removesuffix("_total"))
        assert served == kind.split()[0], f"{name}: contract says {kind}, served {served}"


def test_labels_are_bounded_and_never_the_scrape_targets(scraped: tuple[str, str]) -> None:
    text, _ = scraped
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert not FORBIDDEN_LABELS & set(sample.labels), sample


def test_values_follow_what_the_reconciler_did(scraped: tuple[str, str]) -> None:
    values = samples(scraped[0])
    size = 16 * 65536 * 2
    assert values[("kvshm_agent_info", (("version", "1.2.3"),))] == 1
    assert values[("kvshm_agent_regions", (("phase", "Ready"),))] == 1
    assert values[("kvshm_agent_regions", (("phase", "Failed"),))] == 1
    ok = (("phase", "Ready"), ("region", "ns1/ok"))
    assert values[("kvshm_agent_region_phase", ok)] == 1
    assert values[("kvshm_agent_region_phase", (("phase", "Failed"), ("region", "ns1/ok")))] == 0
    assert values[("kvshm_agent_region_size_bytes", (("region", "ns1/ok"),))] == size
    assert values[("kvshm_agent_allocated_bytes", ())] == size
    assert values[("kvshm_agent_populated_bytes", ())] == size
    assert values[("kvshm_agent_locked_bytes", ())] == size
    assert values[("kvshm_agent_populate_bytes_total", ())] == 2 * size  # "ok" and "gone"
    assert values[("kvshm_agent_populate_seconds_count", ())] == 2
    assert values[("kvshm_agent_orphaned_files", ())] == 1
    assert values[("kvshm_agent_orphaned_bytes", ())] == 8192
    assert values[("kvshm_agent_root_capacity_bytes", ())] > 0
    assert values[("kvshm_agent_root_free_bytes", ())] > 0
    assert values[("kvshm_agent_drains_total", (("outcome", DrainOutcome.RELEASED.value),))] == 1
    assert values[("kvshm_agent_reclaims_total", (("outcome", "done"),))] == 1
    assert values[("kvshm_agent_errors_total", (("reason", "size_mismatch"),))] == 1
    assert values[("kvshm_agent_errors_total", (("reason", "capacity"),))] == 0
    assert values[("kvshm_agent_watch_restarts_total", ())] == 1
    assert values[("kvshm_agent_heartbeat_timestamp_seconds", ())] > 1.7e9


def test_health_endpoints(scraped: tuple[str, str]) -> None:
    _, base = scraped
    assert urllib.request.urlopen(base + "/healthz", timeout=5).status == 200
    assert urllib.request.urlopen(base + "/readyz", timeout=5).status == 200
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(base + "/nope", timeout=5)
    assert missing.value.code == 404


def test_not_ready_before_the_first_pass_and_unhealthy_when_passes_stop() -> None:
    health = Health(stale_after_seconds=0.05)
    ready, why = health.ready()
    assert not ready and "first reconcile pass" in why
    health.passed()
    assert health.ready()[0]
    time.sleep(0.1)
    live, why = health.live()
    assert not live and "no reconcile pass completed" in why
