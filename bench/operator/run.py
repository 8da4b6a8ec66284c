"""The operator at fleet scale: regions over simulated nodes, against a real kube-apiserver v1.28
with etcd (tests/envtest: the binaries of $KUBEBUILDER_ASSETS or .tools/envtest), compared with
the agents alone in the same run.

Two runs, each on a fresh API server of its own with the same nodes and regions:
  - the agents alone (no operator): every region created, reported Ready by its node's
    simulated agent, deleted; the floor the API server and the agents set;
  - with the operator (`python -m kvshm.operator`, production settings except the orphan
    grace period, authenticated as the chart's operator ServiceAccount, so with exactly the
    chart's RBAC) as its own process.
The simulated agents (bench/operator/fleet.py) authenticate as the chart's agent ServiceAccount,
so the server's audit log tells their requests from the operator's. Measured:
  - all Ready (status.phase) from the first create, and all gone after the first delete, each
    also as a ratio to the agents alone;
  - the operator's own API writes per region (create -> Ready, delete -> gone; the audit log,
    Events about a region included) against the agents';
  - handler p50/p99 from the operator's own histogram;
  - the operator's CPU seconds, its memory (RSS) with no region and with all of them (the
    difference per 1,000 regions), and its API requests per region per minute while idle;
  - the API server's and etcd's CPU seconds each way, also as a ratio to the agents alone;
  - orphan reclaim: from a file appearing unclaimed and unheld in an inventory until the
    (simulated) agent was asked to and did remove it.

    python bench/operator/run.py [--regions 500] [--nodes 50] [--grace 10] [--idle 60]

Goals (issue 33): at most 4 operator writes per region each way; all Ready <= 30 s and all gone
<= 30 s for 500 regions over 50 nodes, all Ready <= 5 minutes for 5,000 over 500; handler p99
<= 100 ms; an orphan reclaimed within grace + 10 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # tests.envtest: the real API server the tests run

from bench.operator.fleet import Fleet, watch  # noqa: E402
from tests.envtest.audit import (  # noqa: E402
    AuditEntry,
    AuditPolicy,
    service_account_user,
    writes_by_region,
)
from tests.envtest.chart import apply_crds, install_rbac, service_account_token  # noqa: E402
from tests.envtest.server import EnvTest, start_envtest  # noqa: E402

from kvshm.api import GROUP, REGION_PLURAL, VERSION  # noqa: E402

NAMESPACES = ("team-a", "team-b")
CHART_NAMESPACE = "kvshm-system"
OPERATOR_ACCOUNT, AGENT_ACCOUNT = "kvshm-operator", "kvshm-agent"
OPERATOR_USER = service_account_user(CHART_NAMESPACE, OPERATOR_ACCOUNT)
AGENT_USER = service_account_user(CHART_NAMESPACE, AGENT_ACCOUNT)
WRITE_BUDGET = 4
READY_GOAL_500_SECONDS, GONE_GOAL_500_SECONDS, READY_GOAL_5000_SECONDS = 30.0, 30.0, 300.0
P99_GOAL_SECONDS = 0.1


def region_body(index: int, node: str) -> dict[str, object]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "OffloadRegion",
        "metadata": {"name": f"r{index:05d}", "namespace": NAMESPACES[index % len(NAMESPACES)]},
        "spec": {
            "layout": {"numBlocks": 1024, "cpuPageSize": 65536, "numWorkers": 4},
            "placement": {"nodeNames": [node]},
        },
    }


class Tracker:
    """Every region as a watch shows it (the admin's): no listing of thousands of objects per
    poll, which would load the server the benchmark measures."""

    def __init__(self, custom: kubernetes.client.CustomObjectsApi) -> None:
        self.phases: dict[tuple[str, str], str | None] = {}
        self.reported: set[tuple[str, str]] = set()
        self.errors: queue.Queue[str] = queue.Queue()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        args = (GROUP, VERSION, REGION_PLURAL)
        lister = custom.list_cluster_custom_object
        self._thread = threading.Thread(
            target=watch, args=(lister, args, self._on, self._stop, self.errors), daemon=True
        )
        self._thread.start()

    def _on(self, obj: dict[str, Any], deleted: bool) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        status = obj.get("status") or {}
        with self._lock:
            if deleted:
                self.phases.pop(key, None)
                self.reported.discard(key)
                return
            self.phases[key] = status.get("phase")
            nodes = status.get("nodes") or {}
            if any(entry.get("phase") == "Ready" for entry in nodes.values()):
                self.reported.add(key)

    def count(self, phase: str | None = None) -> int:
        with self._lock:
            if phase is None:
                return len(self.phases)
            return sum(1 for value in self.phases.values() if value == phase)

    def all_reported(self, total: int) -> bool:
        with self._lock:
            return len(self.phases) == total and len(self.reported) == total

    def stop(self) -> None:
        self._stop.set()


def wait(probe: Callable[[], bool], timeout: float, interval: float = 0.1) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if probe():
            return time.monotonic() - started
        time.sleep(interval)
    return None


@dataclass
class Cluster:
    server: EnvTest
    fleet: Fleet
    custom: kubernetes.client.CustomObjectsApi  # the admin's
    tracker: Tracker
    tokens: dict[str, str]


@contextlib.contextmanager
def cluster(nodes: list[str]) -> Iterator[Cluster]:
    """A fresh API server with the CRDs and the chart's RBAC, auditing every request but the
    admin's; the nodes registered and their simulated agents running as the chart's agent."""
    with start_envtest(audit=AuditPolicy.REQUESTS) as server, server.api_client() as admin:
        apply_crds(admin)
        install_rbac(admin, CHART_NAMESPACE)
        tokens = {
            name: service_account_token(admin, CHART_NAMESPACE, name, 3 * 3600)
            for name in (OPERATOR_ACCOUNT, AGENT_ACCOUNT)
        }
        core = kubernetes.client.CoreV1Api(admin)
        for namespace in NAMESPACES:
            core.create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]
        admin.configuration.connection_pool_maxsize = 16
        fleet = Fleet(server.configuration(tokens[AGENT_ACCOUNT]), nodes)
        custom = kubernetes.client.CustomObjectsApi(admin)
        tracker = Tracker(custom)
        try:
            fleet.register(core)
            fleet.start()
            yield Cluster(server, fleet, custom, tracker, tokens)
        finally:
            tracker.stop()
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


def delete_all(
    custom: kubernetes.client.CustomObjectsApi, count: int, nodes: list[str], threads: int
) -> None:
    def delete(index: int) -> None:
        meta: Any = region_body(index, nodes[index % len(nodes)])["metadata"]
        custom.delete_namespaced_custom_object(
            GROUP, VERSION, meta["namespace"], REGION_PLURAL, meta["name"]
        )

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(delete, range(count)))


def per_region(entries: list[AuditEntry], user: str, count: int) -> tuple[float, int]:
    """(mean, most) writes `user` made per region (its objects and Events about it)."""
    counts = writes_by_region(entries, user)
    return sum(counts.values()) / count, max(counts.values(), default=0)


def made_of(entries: list[AuditEntry], user: str, count: int) -> str:
    kinds = Counter(
        f"{e.verb} {e.resource}{'/' + e.subresource if e.subresource else ''}"
        + (f" {e.code}" if e.code >= 400 else "")
        for e in entries
        if e.is_write and e.user == user and e.region is not None
    )
    return ", ".join(f"{kind} {n / count:.2f}" for kind, n in kinds.most_common())


@dataclass
class Run:
    """One run's figures (the agents alone: no operator figures)."""

    ready: float
    gone: float
    writes_up: float  # every client's, per region
    writes_down: float
    agent_writes_up: float
    agent_writes_down: float
    operator_up: tuple[float, int] = (0.0, 0)
    operator_down: tuple[float, int] = (0.0, 0)
    up_made_of: str = ""
    down_made_of: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


Window = tuple[float, list[AuditEntry], int]  # seconds, audit entries, API writes (all users)


def measured(
    args: argparse.Namespace, up: Window, down: Window, extra: dict[str, Any] | None = None
) -> Run:
    """A run's figures from its two windows (create -> Ready, delete -> gone); the operator's
    are zero without one."""
    n = args.regions
    return Run(
        up[0],
        down[0],
        up[2] / n,
        down[2] / n,
        per_region(up[1], AGENT_USER, n)[0],
        per_region(down[1], AGENT_USER, n)[0],
        per_region(up[1], OPERATOR_USER, n),
        per_region(down[1], OPERATOR_USER, n),
        made_of(up[1], OPERATOR_USER, n),
        made_of(down[1], OPERATOR_USER, n),
        extra or {},
    )


def delete_and_measure(env: Cluster, args: argparse.Namespace, nodes: list[str]) -> Window:
    """Delete every region: seconds until all are gone, and the audit entries and API writes
    from the first delete until 2 s after (Events posted after a release land in it), the same
    window with the operator and without."""
    start, writes = env.server.audit_log.mark(), api_writes(env.server)
    started = time.monotonic()
    delete_all(env.custom, args.regions, nodes, args.create_threads)
    assert wait(lambda: env.tracker.count() == 0, args.timeout) is not None, "regions stayed"
    gone = time.monotonic() - started
    time.sleep(2)
    return gone, env.server.audit_log.entries(start), api_writes(env.server) - writes


def agents_alone(args: argparse.Namespace, nodes: list[str]) -> Run:
    with cluster(nodes) as env:
        audit = env.server.audit_log
        server_cpu_start = server_cpu_seconds(env.server)
        start, writes = audit.mark(), api_writes(env.server)
        started = time.monotonic()
        create_all(env.custom, args.regions, nodes, args.create_threads)
        ready = wait(lambda: env.tracker.all_reported(args.regions), args.timeout)
        assert ready is not None, "the simulated agents never reported every region"
        ready = time.monotonic() - started
        server_cpu_ready = server_cpu_seconds(env.server)
        up, writes_up = audit.entries(start), api_writes(env.server) - writes
        server_cpu_delete = server_cpu_seconds(env.server)
        down = delete_and_measure(env, args, nodes)
        server_cpu_end = server_cpu_seconds(env.server)
    server_cpu = {
        "server_cpu_up": server_cpu_ready - server_cpu_start,
        "server_cpu_down": server_cpu_end - server_cpu_delete,
    }
    return measured(args, (ready, up, writes_up), down, server_cpu)


WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")


def api_writes(server: EnvTest) -> int:
    """Writes the API server has served so far, every client together, the admin's creates and
    deletes included (its own apiserver_request_total counter)."""
    request = urllib.request.Request(f"{server.url}/metrics")
    request.add_header("Authorization", f"Bearer {server.admin_token}")
    context = ssl.create_default_context(cafile=str(server.ca_file))
    with urllib.request.urlopen(request, timeout=10, context=context) as response:
        text = response.read().decode()
    total = 0
    for labels, value in re.findall(r"^apiserver_request_total\{([^}]*)\} (\S+)$", text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', labels)).get("verb") in WRITE_VERBS:
            total += int(float(value))
    return total


def free_port() -> int:
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


def proc_memory_mib(pid: int, field: str) -> float:
    match = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    return int(match.group(1)) / 1024 if match else 0.0


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


def start_operator(
    env: Cluster, args: argparse.Namespace, stack: contextlib.ExitStack
) -> tuple[subprocess.Popen[bytes], Callable[[], str], Path]:
    workdir = Path(tempfile.mkdtemp(prefix="kvshm-bench-operator-"))
    kubeconfig = env.server.write_kubeconfig(
        workdir / "kubeconfig", env.tokens[OPERATOR_ACCOUNT], CHART_NAMESPACE
    )
    port = free_port()
    environment = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "KVSHM_OPERATOR_METRICS_PORT": str(port),
        "KVSHM_OPERATOR_ORPHAN_GRACE_SECONDS": str(args.grace),
        "KVSHM_OPERATOR_PEERING_MODE": "standalone",
    }
    log = stack.enter_context((workdir / "operator.log").open("wb"))
    level = os.environ.get("KVSHM_BENCH_OPERATOR_LOG_LEVEL", "warning")
    operator = subprocess.Popen(
        [sys.executable, "-m", "kvshm.operator", "--liveness", "none", "--log-level", level],
        env=environment,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    stack.callback(stop, operator)

    def scrape() -> str:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                return str(answer.read().decode())
        except OSError:
            return ""

    assert wait(lambda: bool(scrape()), 60) is not None, "the operator did not start"
    return operator, scrape, workdir


def with_operator(args: argparse.Namespace, nodes: list[str]) -> Run:
    with contextlib.ExitStack() as stack:
        env = stack.enter_context(cluster(nodes))
        audit = env.server.audit_log
        operator, scrape, workdir = start_operator(env, args, stack)
        time.sleep(5)  # initial listings done, memory settled
        rss_empty = proc_memory_mib(operator.pid, "VmRSS")
        cpu_start, server_cpu_start = proc_cpu_seconds(operator.pid), server_cpu_seconds(env.server)

        start, writes = audit.mark(), api_writes(env.server)
        started = time.monotonic()
        create_all(env.custom, args.regions, nodes, args.create_threads)
        created = time.monotonic() - started
        reported_at: list[float] = []

        def all_ready() -> bool:
            if not reported_at and env.tracker.all_reported(args.regions):
                reported_at.append(time.monotonic() - started)
            return env.tracker.count("Ready") == args.regions

        assert wait(all_ready, args.timeout) is not None, "not every region became Ready"
        ready = time.monotonic() - started
        cpu_ready, server_cpu_ready = proc_cpu_seconds(operator.pid), server_cpu_seconds(env.server)
        time.sleep(2)  # the Ready Events, posted after the status
        up, writes_up = audit.entries(start), api_writes(env.server) - writes

        # idle: every region Ready, the agents heartbeating, nothing else changing
        time.sleep(5)
        rss_full = proc_memory_mib(operator.pid, "VmRSS")
        idle_start, idle_cpu = audit.mark(), proc_cpu_seconds(operator.pid)
        time.sleep(args.idle)
        idle_requests = [e for e in audit.entries(idle_start) if e.user == OPERATOR_USER]
        idle_cpu = proc_cpu_seconds(operator.pid) - idle_cpu

        path = "team-a/ghost/vllm_offload_ghost.mmap"
        env.fleet.add_orphan(nodes[0], path, 4096)
        orphaned = time.monotonic()
        waited = wait(lambda: path in env.fleet.reclaimed_at, args.grace + 120)
        reclaim = env.fleet.reclaimed_at[path] - orphaned if waited is not None else float("inf")

        cpu_delete, server_cpu_delete = (
            proc_cpu_seconds(operator.pid),
            server_cpu_seconds(env.server),
        )
        down = delete_and_measure(env, args, nodes)
        cpu_end, server_cpu_end = proc_cpu_seconds(operator.pid), server_cpu_seconds(env.server)
        peak_rss = proc_memory_mib(operator.pid, "VmHWM")
        metrics_text = scrape()
        errors = []
        while not env.fleet.errors.empty():
            errors.append(env.fleet.errors.get())

    return measured(
        args,
        (ready, up, writes_up),
        down,
        {
            "created": created,
            "agents_done": reported_at[0] if reported_at else ready,
            "reclaim": reclaim,
            "quantiles": histogram_quantiles(metrics_text, (0.5, 0.99)),
            "cpu_up": cpu_ready - cpu_start,
            "cpu_down": cpu_end - cpu_delete,
            "server_cpu_up": server_cpu_ready - server_cpu_start,
            "server_cpu_down": server_cpu_end - server_cpu_delete,
            "idle_requests": Counter(f"{e.verb} {e.resource}" for e in idle_requests),
            "idle_cpu": idle_cpu,
            "rss_empty": rss_empty,
            "rss_full": rss_full,
            "peak_rss": peak_rss,
            "errors": errors,
            "log": workdir / "operator.log",
        },
    )


def report(args: argparse.Namespace, floor: Run, run: Run, load_before: float) -> bool:
    def row(name: str, value: str, goal: str = "", ok: bool | None = None) -> None:
        mark = "" if ok is None else ("PASS" if ok else "FAIL")
        print(f"  {name:<50} {value:>22}  {goal:<18} {mark}")

    x = run.extra
    load = f"1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    print(f"\n{args.regions} regions over {args.nodes} nodes (kube-apiserver v1.28 + etcd + "
          f"simulated agents, {os.cpu_count()} CPUs, {load})")  # fmt: skip
    big = args.regions > 500
    ready_goal = READY_GOAL_5000_SECONDS if big else READY_GOAL_500_SECONDS
    ok_ready = run.ready <= ready_goal
    ok_gone = big or run.gone <= GONE_GOAL_500_SECONDS
    row("all Ready from the first create", f"{run.ready:.1f} s", f"<= {ready_goal:.0f} s", ok_ready)
    row("  agents alone (same regions, fresh server)", f"{floor.ready:.1f} s")
    row("  ratio to the agents alone", f"{run.ready / floor.ready:.2f}x")
    row(f"  creates issued ({args.create_threads} client(s))", f"{x['created']:.1f} s")
    row("  operator lag after the last agent report", f"{run.ready - x['agents_done']:.1f} s")
    row("all gone after the first delete", f"{run.gone:.1f} s",
        "" if big else f"<= {GONE_GOAL_500_SECONDS:.0f} s", None if big else ok_gone)  # fmt: skip
    row("  agents alone", f"{floor.gone:.1f} s")
    row("  ratio to the agents alone", f"{run.gone / floor.gone:.2f}x")
    for way, (mean, most), agents, alone, total, total_alone, parts in (
        ("create -> Ready", run.operator_up, run.agent_writes_up, floor.agent_writes_up,
         run.writes_up, floor.writes_up, run.up_made_of),
        ("delete -> gone", run.operator_down, run.agent_writes_down, floor.agent_writes_down,
         run.writes_down, floor.writes_down, run.down_made_of),
    ):  # fmt: skip
        row(f"operator writes per region, {way} (mean/most)", f"{mean:.2f} / {most}",
            f"<= {WRITE_BUDGET}", most <= WRITE_BUDGET)  # fmt: skip
        print(f"    {parts}")
        row("  agents' writes per region, this run / alone", f"{agents:.2f} / {alone:.2f}")
        row("  all writes per region, this run / alone", f"{total:.2f} / {total_alone:.2f}")
        row("  ratio to the agents alone", f"{total / total_alone:.2f}x")
    worst = 0.0
    for handler, (p50, p99, count) in sorted(x["quantiles"].items()):
        worst = max(worst, p99)
        row(f"handler {handler} p50 / p99 ({int(count)} runs)",
            f"{p50 * 1000:.1f} / {p99 * 1000:.1f} ms")  # fmt: skip
    ok_p99 = worst <= P99_GOAL_SECONDS
    row("handler p99, worst handler", f"{worst * 1000:.1f} ms", "<= 100 ms", ok_p99)
    ok_reclaim = x["reclaim"] <= args.grace + 10
    row(f"orphan reclaimed (grace {args.grace:.0f} s)", f"{x['reclaim']:.1f} s",
        f"<= {args.grace + 10:.0f} s", ok_reclaim)  # fmt: skip
    row("operator CPU: create -> all Ready", f"{x['cpu_up']:.1f} s")
    row("operator CPU: delete -> all gone", f"{x['cpu_down']:.1f} s")
    row("operator CPU while idle", f"{100 * x['idle_cpu'] / args.idle:.1f} %")
    for way, key in (
        ("create -> all Ready", "server_cpu_up"),
        ("delete -> all gone", "server_cpu_down"),
    ):
        alone = floor.extra[key]
        row(f"API server + etcd CPU: {way}", f"{x[key]:.1f} s")
        row("  agents alone / ratio", f"{alone:.1f} s / {x[key] / max(alone, 0.01):.2f}x")
    per_thousand = (x["rss_full"] - x["rss_empty"]) / (args.regions / 1000)
    row("operator RSS: no region / all Ready", f"{x['rss_empty']:.0f} / {x['rss_full']:.0f} MiB")
    row("  per 1,000 regions", f"{per_thousand:.1f} MiB")
    row("operator peak RSS", f"{x['peak_rss']:.0f} MiB")
    idle = sum(x["idle_requests"].values())
    row(f"operator API requests while idle ({args.idle:.0f} s)", f"{idle}")
    row("  per region per minute", f"{idle / args.regions / (args.idle / 60):.5f}")
    if idle:
        print(f"    {dict(x['idle_requests'])}")
    if x["errors"]:
        print(f"  simulated agents saw {len(x['errors'])} API errors, e.g. {x['errors'][:3]}")
    print(f"  operator log: {x['log']}")
    writes_ok = max(run.operator_up[1], run.operator_down[1]) <= WRITE_BUDGET
    return ok_ready and ok_gone and ok_p99 and ok_reclaim and writes_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regions", type=int, default=500)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--grace", type=float, default=10.0, help="orphan grace period (s)")
    parser.add_argument("--idle", type=float, default=60.0, help="idle window measured (s)")
    parser.add_argument(
        "--create-threads", type=int, default=1, help="clients creating the regions at once"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="for each wait (s)")
    args = parser.parse_args()
    # a SIGTERM still stops the servers and the operator (the context managers' exits run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()[0]  # other work on the machine moves every time below
    nodes = [f"node-{i:03d}" for i in range(args.nodes)]
    print(f"agents alone: {args.nodes} simulated agents, {args.regions} regions, no operator")
    floor = agents_alone(args, nodes)
    print("with the operator ...")
    run = with_operator(args, nodes)
    return 0 if report(args, floor, run, load_before) else 1


if __name__ == "__main__":
    sys.exit(main())
