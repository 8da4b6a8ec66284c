"""Issue 15's attacks against an agent, measured: run once per source tree, compare the rows.

Each attack is made the way tests/agent makes it (an unprivileged tenant process, a real tmpfs,
a real `kvshm-agent --local` process), against the kvshm source under --source (default: this
checkout; give an older tree, e.g. from `git archive <rev> agent tests`, for "before"). One JSON
line per attack: how long the agent took, its peak memory, tmpfs used, and how long another
region took to go Ready meanwhile (null: it never did within the limit).

    python bench/agent/hostile.py [--source DIR] [--only http,yaml,...]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.agent.probes import peak_mib, time_to, tmpfs, used_mib  # noqa: E402
from tests.agent.hostile import (  # noqa: E402  (the repository root is on the path now)
    TENANT_PYTHON,
    TENANT_UID,
    RunningAgent,
    tenant,
    tenant_manifest,
    tenant_process,
    write_regions,
)
from tests.agent.test_console_names import _HOSTILE_NAMES  # noqa: E402
from tests.agent.test_event_ring_hostile import _PLANT, crafted_trailer  # noqa: E402
from tests.agent.test_fifo_swap import _SWAPPER  # noqa: E402
from tests.agent.test_hard_links import _LINK  # noqa: E402
from tests.agent.test_inventory_bounds import _FILL  # noqa: E402
from tests.agent.test_smaller_hostile_items import _TRUNCATE  # noqa: E402

Row = dict[str, Any]


class Bench:
    def __init__(self, source: Path) -> None:
        self.env = {"PYTHONPATH": str(source / "agent")}
        self.source = source

    def agent(
        self, regions: Path, root: Path, *extra: str, env: dict[str, str] | None = None, **kw: Any
    ) -> RunningAgent:
        return RunningAgent(regions, root, *extra, env={**self.env, **(env or {})}, **kw)

    def python(self, code: str, *args: str) -> Row:
        """Run code in-process against the source tree; it prints one JSON object."""
        done = subprocess.run(
            [sys.executable, "-c", code, *args],
            env={**os.environ, **self.env},
            capture_output=True,
            text=True,
            timeout=300,
        )
        if done.returncode != 0:
            return {"error": done.stderr.strip().splitlines()[-1:]}
        row: Row = json.loads(done.stdout.strip().splitlines()[-1])
        return row


@contextmanager
def workspace() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kvshm-bench-", dir="/dev/shm"))
    path.chmod(0o711)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- the attacks ------------------------------------------------------------------------------

_IDLE = """
import socket, sys, time
held = []
for _ in range(int(sys.argv[3])):
    try:
        held.append(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2))
    except OSError:
        pass
print("holding", len(held), flush=True)
time.sleep(120)
"""


def attack_http(bench: Bench) -> Row:
    with workspace() as work:
        regions = work / "regions"
        regions.mkdir()
        write_regions(regions, "a.yaml", tenant_manifest("before"))
        with bench.agent(regions, work / "root", "--port", "0", nofile=128) as agent:
            agent.saw("tenant/before  Ready")
            host, port = agent.url.removeprefix("http://").rsplit(":", 1)
            attacker = tenant_process(_IDLE, host, port, "200")
            assert attacker.stdout is not None
            held = attacker.stdout.readline().split()[-1]
            started = time.monotonic()
            try:
                urllib.request.urlopen(agent.url + "/healthz", timeout=10).read()
                healthz: float | None = round(time.monotonic() - started, 3)
            except OSError:
                healthz = None
            write_regions(regions, "b.yaml", tenant_manifest("other"))
            other = time_to(agent, "tenant/other  Ready", 30)
            row = {"connections_held": int(held), "healthz_s": healthz, "threads": agent.threads()}
            row |= {"other_ready_s": other, "peak_mib": peak_mib(agent.pid)}
            attacker.kill()
            attacker.wait()
            return row


_BOMB = """
import os, sys
levels = int(sys.argv[2])
lines = ['a0: &a0 ["x","x","x","x","x","x","x","x","x","x"]']
for level in range(1, levels):
    lines.append(f"a{level}: &a{level} [" + ",".join([f"*a{level - 1}"] * 10) + "]")
lines += ["apiVersion: kvshm.dev/v1alpha1", "kind: OffloadRegion",
          "metadata: {name: bomb, namespace: tenant}",
          f"spec: {{layout: {{numBlocks: *a{levels - 1}, cpuPageSize: 4096, numWorkers: 1}}}}"]
open(sys.argv[1] + "/bomb.yaml", "w").write("\\n".join(lines) + "\\n")
"""


def attack_yaml(bench: Bench) -> Row:
    with workspace() as work:
        regions = work / "regions"
        regions.mkdir()
        os.chown(regions, TENANT_UID, TENANT_UID)
        tenant(_BOMB, str(regions), "8")  # 10**8 items: 9 levels exhaust memory
        write_regions(regions, "good.yaml", tenant_manifest("other"))
        started = time.monotonic()
        with bench.agent(regions, work / "root", "--no-http") as agent:
            other = time_to(agent, "tenant/other  Ready", 30)
            row = {"other_ready_s": other, "peak_mib": peak_mib(agent.pid)}
            row["agent_alive"] = agent.process.poll() is None
        row["elapsed_s"] = round(time.monotonic() - started, 1)
        row["longest_line"] = max((len(line) for line in agent.lines), default=0)
        return row


def attack_ring(bench: Bench) -> Row:
    """A 64 GiB sparse kvshm_events and a trailer claiming 2**21 chunks, then a restart."""
    with tmpfs("256m") as mount, workspace() as work:
        regions = work / "regions"
        regions.mkdir()
        root = mount / "root"
        write_regions(regions, "a.yaml", tenant_manifest("sparse"), tenant_manifest("crafted"))
        with bench.agent(regions, root, "--no-http") as agent:
            agent.saw("tenant/sparse  Ready")
            agent.saw("tenant/crafted  Ready")
        tenant(_PLANT, str(root / "tenant/sparse/kvshm_events"), str(64 << 30), "")
        size, trailer = crafted_trailer(1 << 21)
        tenant(_PLANT, str(root / "tenant/crafted/kvshm_events"), str(size), trailer.hex())
        before = used_mib(mount)
        write_regions(regions, "b.yaml", tenant_manifest("other", "elsewhere"))
        started = time.monotonic()
        with bench.agent(regions, root, "--port", "0", "--resync-seconds", "5") as agent:
            other = time_to(agent, "elsewhere/other  Ready", 120)
            both = time_to(agent, "tenant/crafted  Ready", 5) is not None
            row: Row = {"restart_to_other_ready_s": other, "victims_ready": both}
            row["peak_mib"] = peak_mib(agent.pid)
            row["tmpfs_used_mib"] = {"before": before, "after": used_mib(mount)}
            row["elapsed_s"] = round(time.monotonic() - started, 1)
        return row


_INVENTORY = """
import json, os, resource, sys, time
from kvshm.agent.root.holders import HoldChecker
from kvshm.agent.reconciler import NodeReconciler, ReconcilerSettings
from kvshm.agent.root.saferoot import RegionRoot
from kvshm.agent.view import ClusterView
class Quiet:
    def prepare(self, *a): pass
    def publish(self, *a): pass
    def close(self, *a): pass
    def file_names(self, *a): return []
root = RegionRoot(sys.argv[1])
reconciler = NodeReconciler(root, Quiet(), ReconcilerSettings(), holds=HoldChecker())
view = ClusterView("node-a", {}, {})
times = []
for _ in range(3):
    started = time.monotonic()
    result = reconciler.reconcile(view)
    times.append(time.monotonic() - started)
status = json.dumps({"files": [f.to_status() for f in result.root_scan.inventory.files]})
print(json.dumps({"pass_s": round(min(times), 3), "status_bytes": len(status),
    "problems_bytes": len("; ".join(result.root_scan.problems)),
    "peak_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))
"""


def attack_inventory(bench: Bench) -> Row:
    with workspace() as work:
        root = work / "root"
        directory = root / "t1" / "flooder"
        directory.mkdir(parents=True)
        for each in (root, root / "t1"):
            each.chmod(0o711)
        os.chown(directory, TENANT_UID, TENANT_UID)
        tenant(_FILL, str(directory), "10001")
        return bench.python(_INVENTORY, str(root))


def attack_descriptors(bench: Bench) -> Row:
    with workspace() as work:
        regions = work / "regions"
        regions.mkdir()
        for i in range(100):
            write_regions(
                regions,
                f"r{i:02}.yaml",
                tenant_manifest(f"r{i:02}", blocks=4, page=4096, workers=1),
            )
        started = time.monotonic()
        with bench.agent(regions, work / "root", "--port", "0", nofile=300) as agent:
            time.sleep(20)
            text = agent.output()
            ready = len(set(re.findall(r"tenant/(r\d\d)  Ready", text)))
            refused = len(set(re.findall(r"tenant/(r\d\d)  Failed", text)))
            try:
                code = urllib.request.urlopen(agent.url + "/healthz", timeout=5).status
            except OSError as exc:
                code = str(exc)
            failed_passes = text.count("reconcile pass failed")
            row = {"ready_of_100": ready, "refused": refused, "healthz": code}
            row |= {"failed_passes": failed_passes, "descriptors": agent.descriptors()}
            row["elapsed_s"] = round(time.monotonic() - started, 1)
        return row


def attack_hard_link(bench: Bench) -> Row:
    with tmpfs("64m") as mount, workspace() as work:
        regions = work / "regions"
        regions.mkdir()
        root = mount / "root"
        write_regions(
            regions, "a.yaml", tenant_manifest("linked", blocks=16, page=1 << 20, workers=1)
        )
        with bench.agent(regions, root, "--no-http", "--drain-grace-seconds", "1") as agent:
            agent.saw("tenant/linked  Ready")
            region_file = root / "tenant/linked/vllm_offload_linked.mmap"
            tenant(_LINK, str(region_file), str(region_file.parent / "keep"))
            (regions / "a.yaml").unlink()
            removed = time_to(agent, "tenant/linked  Removed", 30)
            line = next((x for x in agent.lines if "tenant/linked  Removed" in x), "")
        return {
            "removed_s": removed,
            "tmpfs_used_after_removed_mib": used_mib(mount),
            "region_name_removed": not region_file.exists(),
            "memory_reported": "allocated after its removal" in line,
        }


_OPENER = """
import json, os, sys, time
from kvshm.region import safefile
dir_fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
tries = 0
deadline = time.monotonic() + 2.5
while time.monotonic() < deadline:
    tries += 1
    try:
        os.close(safefile.open_existing(dir_fd, "target", "target"))
    except Exception:
        pass
print(json.dumps({"tries": tries}))
"""


def attack_fifo(bench: Bench) -> Row:
    with workspace() as work:
        directory = work / "tenant"
        directory.mkdir()
        os.chown(directory, TENANT_UID, TENANT_UID)
        swapper = tenant_process(_SWAPPER, str(directory), "3")
        assert swapper.stdout is not None and swapper.stdout.readline().strip() == "swapping"
        row = bench.python(_OPENER, str(directory))
        row["fifo_opened"] = int(swapper.stdout.readline().split()[1])
        swapper.wait(10)
        return row


def attack_console(bench: Bench) -> Row:
    """File names with terminal escapes and bytes that are not UTF-8, an ASCII-strict console."""
    with workspace() as work:
        regions = work / "regions"
        regions.mkdir()
        root = work / "root"
        write_regions(regions, "a.yaml", tenant_manifest("victim"))
        strict = {"PYTHONIOENCODING": "ascii:strict", "LANG": "C", "LC_ALL": "C"}
        extra = ("--no-http", "--drain-grace-seconds", "1")
        with bench.agent(regions, root, *extra, env=strict) as agent:
            agent.saw("tenant/victim  Ready")
            tenant(_HOSTILE_NAMES, str(root / "tenant/victim"))
            (regions / "a.yaml").unlink()
            removed = time_to(agent, "tenant/victim  Removed", 15)
            write_regions(regions, "b.yaml", tenant_manifest("other"))
            other = time_to(agent, "tenant/other  Ready", 15)
        output = agent.output()
        return {
            "removed_printed_s": removed,
            "other_ready_s": other,
            "raw_escapes_printed": "\x1b" in output,
            "tracebacks": output.count("Traceback"),
        }


def attack_truncate(bench: Bench) -> Row:
    """The tenant truncates its Ready region file to 4 KiB."""
    with workspace() as work:
        regions = work / "regions"
        regions.mkdir()
        root = work / "root"
        write_regions(regions, "a.yaml", tenant_manifest("cut"))
        with bench.agent(regions, root, "--no-http", "--resync-seconds", "1") as agent:
            agent.saw("tenant/cut  Ready")
            tenant(_TRUNCATE, str(root / "tenant/cut/vllm_offload_cut.mmap"))
            failed = time_to(agent, "tenant/cut  Failed", 10)
            last = [line for line in agent.lines if "tenant/cut  " in line][-1]
        return {"reported_failed_s": failed, "last_status": last.split("  ")[2]}


ATTACKS: dict[str, Callable[[Bench], Row]] = {
    "http": attack_http,
    "yaml": attack_yaml,
    "ring": attack_ring,
    "inventory": attack_inventory,
    "descriptors": attack_descriptors,
    "hard_link": attack_hard_link,
    "fifo": attack_fifo,
    "console": attack_console,
    "truncate": attack_truncate,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", type=Path, default=REPO, help="kvshm tree (agent/ below it)")
    parser.add_argument("--only", default=",".join(ATTACKS), help="comma-separated attacks")
    args = parser.parse_args()
    assert os.geteuid() == 0 and os.access(TENANT_PYTHON, os.X_OK), "run as root"
    bench = Bench(args.source.resolve())
    for name in args.only.split(","):
        started = time.monotonic()
        try:
            row = ATTACKS[name](bench)
        except Exception as exc:  # a row saying what broke, and the next attack
            row = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        row = {"attack": name, "source": str(args.source), **row}
        row["bench_s"] = round(time.monotonic() - started, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
