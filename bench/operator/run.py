"""The operator at scale: 500 regions over 50 nodes, against a real kube-apiserver v1.28 with
etcd (tests/envtest: the binaries of $KUBEBUILDER_ASSETS or .tools/envtest), simulated agents.

Measured, with the operator (`python -m kvshm.operator`, production settings except the orphan
grace period, authenticated as the chart's operator ServiceAccount, so with exactly the
chart's RBAC) as its own process:
  - time from the first create until every region's status.phase is Ready;
  - time from the first delete until every region is gone (finalizers released);
  - reconcile duration p50/p99 per handler, from the operator's own histogram (handler time);
  - operator CPU seconds and peak RSS, the API server's (with etcd) CPU seconds, and the API
    writes per region (the server's own request counter);
  - orphan reclaim: from a file appearing unclaimed and unheld in an inventory until the
    (simulated) agent was asked to and did remove it.
Baseline, same run and set-up (a fresh API server of its own), no operator: the time the
simulated agents alone need to report Ready for every region — the floor set by the API server
and the agents, which the operator's all-Ready time is compared with.

    python bench/operator/run.py [--regions 500] [--nodes 50] [--grace 10] [--create-threads 1]

Goals (issue 5): all Ready <= 60 s; p99 reconcile <= 100 ms; orphan reclaimed within grace + 10 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import kubernetes

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.envtest: the real API server the tests run

from bench.operator.fleet import Fleet  # noqa: E402
from tests.envtest.chart import apply_crds, install_rbac, service_account_token  # noqa: E402
from tests.envtest.server import EnvTest, start_envtest  # noqa: E402

from kvshm.api import GROUP, REGION_PLURAL, VERSION  # noqa: E402

NAMESPACES = ("team-a", "team-b")
CHART_NAMESPACE = "kvshm-system"


def region_body(index: int, node: str) -> dict[str, object]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OffloadRegion",
        "metadata": {"name": f"r{index:04d}", "namespace": NAMESPACES[index % len(NAMESPACES)]},
        "spec": {
            "layout": {"numBlocks": 1024, "cpuPageSize": 65536, "numWorkers": 4},
            "placement": {"nodeNames": [node]},
        },
    }


def regions(custom: kubernetes.client.CustomObjectsApi) -> list[dict[str, Any]]:
    listing = cast(dict[str, Any], custom.list_cluster_custom_object(GROUP, VERSION, REGION_PLURAL))
    return list(listing["items"])


def reported(region: dict[str, Any]) -> bool:
    """Its agent reported it Ready (status.nodes), whatever the operator made of that yet."""
    nodes = (region.get("status") or {}).get("nodes") or {}
    return any(entry.get("phase") == "Ready" for entry in nodes.values())


def phase(region: dict[str, Any]) -> str | None:
    return (region.get("status") or {}).get("phase")


def wait(probe: Callable[[], bool], timeout: float, interval: float = 0.25) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if probe():
            return time.monotonic() - started
        time.sleep(interval)
    return None


@contextlib.contextmanager
def cluster(nodes: list[str]) -> Iterator[tuple[EnvTest, Fleet]]:
    """A fresh API server with the CRDs and the chart's RBAC, the nodes registered and their
    simulated agents running (as the admin: they also create the Nodes)."""
    with start_envtest() as server:
        with server.api_client() as admin:
            apply_crds(admin)
            install_rbac(admin, CHART_NAMESPACE)
        fleet = Fleet(server.configuration(), nodes)
        try:
            for namespace in NAMESPACES:
                fleet.core.create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]
            fleet.register()
            fleet.start()
            yield server, fleet
        finally:
            fleet.stop()


def create_all(
    custom: kubernetes.client.CustomObjectsApi, count: int, nodes: list[str], threads: int
) -> None:
    """Create the regions, from `threads` clients at once (1: one after another, as
    `kubectl apply -f` of a folder does)."""

    def create(index: int) -> None:
        body = region_body(index, nodes[index % len(nodes)])
        namespace = body["metadata"]["namespace"]  # type: ignore[index]
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, REGION_PLURAL, body)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(create, range(count)))


def baseline(count: int, nodes: list[str], threads: int) -> tuple[float, Counter[str]]:
    """Agents alone: every region reported Ready by its node, no operator involved; the time
    and the API writes that took."""
    with cluster(nodes) as (server, fleet):
        custom = fleet.custom
        before = api_writes(server)
        started = time.monotonic()
        create_all(custom, count, nodes, threads)

        def all_reported() -> bool:
            items = regions(custom)
            return len(items) == count and all(map(reported, items))

        waited = wait(all_reported, 300)
        assert waited is not None, "the simulated agents never reported every region"
        return time.monotonic() - started, api_writes(server) - before


WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")


def api_writes(server: EnvTest) -> Counter[str]:
    """Writes the API server has served so far, by `VERB resource[/subresource]` (its own
    apiserver_request_total counter, every client together)."""
    request = urllib.request.Request(f"{server.url}/metrics")
    request.add_header("Authorization", f"Bearer {server.admin_token}")
    context = ssl.create_default_context(cafile=str(server.ca_file))
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        text = response.read().decode()
    counts: Counter[str] = Counter()
    for labels, value in re.findall(r"^apiserver_request_total\{([^}]*)\} (\S+)$", text, re.M):
        label = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if label.get("verb") in WRITE_VERBS:
            resource = label["resource"] + (
                f"/{label['subresource']}" if label["subresource"] else ""
            )
            counts[f"{label['verb']} {resource}"] += int(float(value))
    return counts


def writes_line(counts: Counter[str], per: int) -> str:
    top = ", ".join(f"{key} {value / per:.1f}" for key, value in counts.most_common(4))
    return f"{sum(counts.values()) / per:.1f} per region ({top})"


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def server_cpu_seconds(server: EnvTest) -> float:
    """CPU seconds of kube-apiserver and etcd together (EnvTest keeps their processes)."""
    return sum(proc_cpu_seconds(p.pid) for p in server._processes.values())


def proc_memory_kib(pid: int, field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(match.group(1)) if match else 0


def histogram_quantiles(text: str, quantiles: tuple[float, ...]) -> dict[str, list[float]]:
    """histogram_quantile() per handler from kvshm_operator_reconcile_duration_seconds buckets."""
    buckets: dict[str, list[tuple[float, float]]] = {}
    pattern = (
        r'kvshm_operator_reconcile_duration_seconds_bucket\{handler="(\w+)",le="([^"]+)"\} (\S+)'
    )
    for handler, le, value in re.findall(pattern, text):
        buckets.setdefault(handler, []).append((float(le), float(value)))
    result = {}
    for handler, points in buckets.items():
        points.sort()
        total = points[-1][1]
        if not total:
            continue
        values = []
        for q in quantiles:
            rank, lower_bound, lower_count = q * total, 0.0, 0.0
            for bound, count in points:
                if count >= rank:
                    if bound == float("inf"):
                        values.append(lower_bound)
                    else:
                        fraction = (rank - lower_count) / max(count - lower_count, 1e-9)
                        values.append(lower_bound + (bound - lower_bound) * fraction)
                    break
                lower_bound, lower_count = bound, count
        result[handler] = [*values, total]
    return result


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regions", type=int, default=500)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--grace", type=float, default=10.0, help="orphan grace period (s)")
    parser.add_argument(
        "--create-threads", type=int, default=1, help="clients creating the regions at once"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()[0]  # other work on the machine moves every time below
    nodes = [f"node-{i:02d}" for i in range(args.nodes)]

    print(f"baseline: {args.nodes} simulated agents report {args.regions} regions, no operator")
    floor, floor_writes = baseline(args.regions, nodes, args.create_threads)

    print("with the operator ...")
    with contextlib.ExitStack() as stack:
        server, fleet = stack.enter_context(cluster(nodes))
        custom = fleet.custom
        workdir = Path(tempfile.mkdtemp(prefix="kvshm-bench-operator-"))
        with server.api_client() as admin:
            token = service_account_token(admin, CHART_NAMESPACE, "kvshm-operator", 3600)
        kubeconfig = server.write_kubeconfig(workdir / "kubeconfig", token, CHART_NAMESPACE)
        port = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(kubeconfig),
            "KVSHM_OPERATOR_METRICS_PORT": str(port),
            "KVSHM_OPERATOR_ORPHAN_GRACE_SECONDS": str(args.grace),
            "KVSHM_OPERATOR_PEERING_MODE": "standalone",
        }
        log = stack.enter_context(open(workdir / "operator.log", "wb"))
        operator = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvshm.operator",
                "--liveness",
                "none",
                "--log-level",
                os.environ.get("KVSHM_BENCH_OPERATOR_LOG_LEVEL", "warning"),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        stack.callback(stop, operator)
        metrics_url = f"http://127.0.0.1:{port}/metrics"

        def scrape() -> str:
            try:
                with urllib.request.urlopen(metrics_url, timeout=5) as response:
                    return str(response.read().decode())
            except OSError:
                return ""

        assert wait(lambda: bool(scrape()), 60) is not None, "the operator did not start"
        time.sleep(2)  # initial listings done
        cpu_idle_start = proc_cpu_seconds(operator.pid)
        server_cpu_start = server_cpu_seconds(server)

        writes_before = api_writes(server)
        started = time.monotonic()
        create_all(custom, args.regions, nodes, args.create_threads)
        created = time.monotonic() - started

        reported_at: list[float] = []

        def all_ready() -> bool:
            items = regions(custom)
            if len(items) != args.regions:
                return False
            if not reported_at and all(map(reported, items)):
                reported_at.append(time.monotonic() - started)
            return all(phase(item) == "Ready" for item in items)

        assert wait(all_ready, 600) is not None, "not every region became Ready"
        ready = time.monotonic() - started
        writes_ready = api_writes(server)
        agents_done = reported_at[0] if reported_at else ready
        cpu_after_ready = proc_cpu_seconds(operator.pid)
        server_cpu_ready = server_cpu_seconds(server)

        path = "team-a/ghost/vllm_offload_ghost.mmap"
        fleet.add_orphan(nodes[0], path, 4096)
        orphaned = time.monotonic()
        waited = wait(lambda: path in fleet.reclaimed_at, args.grace + 120)
        reclaim = fleet.reclaimed_at[path] - orphaned if waited is not None else float("inf")

        cpu_before_delete = proc_cpu_seconds(operator.pid)
        server_cpu_delete = server_cpu_seconds(server)
        started = time.monotonic()
        for item in regions(custom):
            meta = item["metadata"]
            custom.delete_namespaced_custom_object(
                GROUP,
                VERSION,
                meta["namespace"],
                REGION_PLURAL,
                meta["name"],
            )
        assert wait(lambda: not regions(custom), 600) is not None, "regions stayed"
        gone = time.monotonic() - started
        writes_gone = api_writes(server)
        cpu_end = proc_cpu_seconds(operator.pid)
        server_cpu_end = server_cpu_seconds(server)
        peak_rss = proc_memory_kib(operator.pid, "VmHWM") / 1024
        metrics_text = scrape()

    quantiles = histogram_quantiles(metrics_text, (0.5, 0.99))
    errors = []
    while not fleet.errors.empty():
        errors.append(fleet.errors.get())

    def row(name: str, value: str, goal: str = "", ok: bool | None = None) -> None:
        mark = "" if ok is None else ("PASS" if ok else "FAIL")
        print(f"  {name:<44} {value:>14}  {goal:<16} {mark}")

    load = f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    setup = f"kube-apiserver v1.28 + etcd + simulated agents, {os.cpu_count()} CPUs, {load}"
    print(f"\n{args.regions} regions over {args.nodes} nodes ({setup})")
    row("baseline: agents alone report all Ready", f"{floor:.1f} s")
    row(f"creates issued ({args.create_threads} at a time)", f"{created:.1f} s")
    row("all Ready (status.phase), from first create", f"{ready:.1f} s", "<= 60 s", ready <= 60)
    row("  ratio to the agents-only floor", f"{ready / floor:.2f}x")
    row("  agents had reported all Ready at", f"{agents_done:.1f} s")
    row("  operator lag after the last agent report", f"{ready - agents_done:.1f} s")
    row("all gone after delete (finalizers released)", f"{gone:.1f} s")
    row(f"orphan reclaimed (grace {args.grace:.0f} s)", f"{reclaim:.1f} s",
        f"<= {args.grace + 10:.0f} s", reclaim <= args.grace + 10)  # fmt: skip
    print(f"  API writes, agents alone:     {writes_line(floor_writes, args.regions)}")
    print(
        f"  API writes, create -> Ready:  {writes_line(writes_ready - writes_before, args.regions)}"
    )
    print(
        f"  API writes, delete -> gone:   {writes_line(writes_gone - writes_ready, args.regions)}"
    )
    worst = 0.0
    for handler, (p50, p99, count) in sorted(quantiles.items()):
        worst = max(worst, p99)
        row(f"reconcile {handler} p50 / p99 ({int(count)} runs)",
            f"{p50 * 1000:.1f}/{p99 * 1000:.1f} ms")  # fmt: skip
    row("reconcile p99, worst handler", f"{worst * 1000:.1f} ms", "<= 100 ms", worst <= 0.1)
    row("operator CPU: create -> all Ready", f"{cpu_after_ready - cpu_idle_start:.1f} s")
    row("operator CPU: delete -> all gone", f"{cpu_end - cpu_before_delete:.1f} s")
    row(
        "API server + etcd CPU: create -> all Ready", f"{server_cpu_ready - server_cpu_start:.1f} s"
    )
    row("API server + etcd CPU: delete -> all gone", f"{server_cpu_end - server_cpu_delete:.1f} s")
    row("operator peak RSS", f"{peak_rss:.0f} MiB")
    if errors:
        print(f"  simulated agents saw {len(errors)} API errors, e.g. {errors[:3]}")
    print(f"  operator log: {workdir / 'operator.log'}")
    return 0 if ready <= 60 and worst <= 0.1 and reclaim <= args.grace + 10 else 1


if __name__ == "__main__":
    sys.exit(main())
