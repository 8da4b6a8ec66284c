"""The engine benchmark: vLLM 0.33's real offline engine serving workloads with (a) no CPU
tier, (b) vLLM's own CPUOffloadingSpec and (c) kvshm's plugin on a region made by the agent
(`kvshm-agent --local --once`), the same CPU bytes for (b) and (c), each configuration in a
fresh process (bench/engine/engine.py); then the ratios against the baselines of this run.

    python3 bench/engine/run.py --shapes llama-3.1-8b --configs a,b,c --out DIR
    python3 bench/engine/run.py --startup-gib 64            # engine start with a 64 GiB tier
    python3 bench/engine/run.py --restart                   # SIGKILL and restart on one region
    python3 bench/engine/run.py --dry                       # the plumbing only (no GPU)

On a GPU machine without vLLM's compiled extensions (scripts/prepare-gpu-env.sh's .gpu/),
the engine processes register stand-ins for the few compiled ops they call
(bench/engine/standins.py) and print which.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path[:0] = [str(REPO)]

from bench.engine.report import print_report  # noqa: E402
from bench.engine.shapes import BLOCK_SIZE, SHAPES, Shape  # noqa: E402

ENGINE = REPO / "bench" / "engine" / "engine.py"
GIB = 1 << 30
NAMESPACE = "default"  # the agent's local mode puts a region under <root>/<namespace>/<name>


def python_env() -> dict[str, str]:
    env = dict(os.environ)
    # the startup hook first (bench/engine/startup/sitecustomize.py); kvshm's sources come with
    # the interpreter (the editable install, or .gpu/env.sh's PYTHONPATH)
    startup = str(REPO / "bench" / "engine" / "startup")
    env["PYTHONPATH"] = os.pathsep.join([startup, env.get("PYTHONPATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def engine_process(spec_path: Path, result_path: Path) -> subprocess.Popen[str]:
    """One engine (bench/engine/engine.py) in a fresh process, its output on a pipe."""
    return subprocess.Popen(
        [sys.executable, str(ENGINE), str(spec_path), str(result_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=python_env(),
    )


def region_layout(model_dir: Path, instance_id: str, cpu_bytes: int) -> dict[str, Any]:
    """`kvshm layout`'s OffloadRegion for the model and CPU bytes (kvshm.sizing's numbers)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvshm.cli",
            "layout",
            str(model_dir),
            "--id",
            instance_id,
            "--cpu-bytes",
            str(cpu_bytes),
            "--block-size",
            str(BLOCK_SIZE),
        ],
        check=True,
        capture_output=True,
        text=True,
        env=python_env(),
    ).stdout
    document: dict[str, Any] = yaml.safe_load(out)
    return document


def region_bytes(document: dict[str, Any]) -> int:
    layout = document["spec"]["layout"]
    row = -(-int(layout["cpuPageSize"]) * int(layout.get("numWorkers", 1)) // 4096) * 4096
    return int(layout["numBlocks"]) * row


def agent_region(document: dict[str, Any], root: Path) -> tuple[Path, float]:
    """Have the agent create and populate the region (local mode, once); returns the region's
    directory and the agent's seconds."""
    regions = Path(tempfile.mkdtemp(prefix="kvshm-engine-regions-"))
    (regions / "region.yaml").write_text(yaml.safe_dump(document))
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvshm.agent.cli",
            "--local",
            str(regions),
            "--once",
            "--root",
            str(root),
            "--no-http",
            "--huge-pages",
            "ignore",
            "--drain-grace-seconds",
            "0",
        ],
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=600,
    )
    seconds = time.perf_counter() - started
    shutil.rmtree(regions, ignore_errors=True)
    print(done.stdout.strip().splitlines()[-2] if done.stdout.strip() else "", flush=True)
    if done.returncode != 0:
        raise RuntimeError(f"kvshm-agent failed ({done.returncode}): {done.stderr[-2000:]}")
    directory = root / NAMESPACE / document["metadata"]["name"]
    if not directory.is_dir():
        raise RuntimeError(f"the agent made no {directory}: {done.stdout[-2000:]}")
    return directory, seconds


def remove_vllm_region(engine_id: str) -> None:
    """vLLM's own tier leaves /dev/shm/vllm_offload_<id>.mmap[.i] behind a process that ends
    without teardown: remove them so the next configuration has the memory."""
    for path in Path("/dev/shm").glob(f"vllm_offload_{engine_id}.mmap*"):
        path.unlink(missing_ok=True)


def run_engine(spec: dict[str, Any], work: Path, log: Path, timeout: float) -> dict[str, Any]:
    """One configuration in a fresh process; its output goes to the console and the log."""
    name = spec["label"]
    spec_path, result_path = work / f"{name}.spec.json", work / f"{name}.result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    print(f"== {name}: {spec['tier']} on {spec['shape']}", flush=True)
    started = time.perf_counter()
    with open(log, "a") as out:
        process = engine_process(spec_path, result_path)
        assert process.stdout is not None
        deadline = started + timeout
        for line in process.stdout:
            out.write(line)
            if not (" INFO " in line or " DEBUG " in line) or "kvshm" in line:
                print("   ", line.rstrip()[:300], flush=True)
            if time.perf_counter() > deadline:
                process.kill()
                break
        process.wait()
    wall = time.perf_counter() - started
    if result_path.exists():
        result: dict[str, Any] = json.loads(result_path.read_text())
    else:
        result = {"ok": False, "error": f"no result (exit {process.returncode}, {wall:.0f}s)"}
    result["process_wall_s"] = wall
    if not result.get("ok"):
        print(f"   {name} FAILED: {str(result.get('error'))[-1500:]}", flush=True)
    return result


def base_spec(
    args: argparse.Namespace, shape: Shape, model_dir: Path, tier: str, label: str
) -> dict[str, Any]:
    return {
        "label": label,
        "tier": tier,
        "shape": shape.name,
        "model_dir": str(model_dir),
        "gpu_kv_bytes": int(args.gpu_kv_gib * GIB),
        "max_model_len": args.max_model_len,
        "kv_cache_layout": args.layout,
        "engine_id": f"bench-{tier}-{uuid.uuid4().hex[:6]}",
    }


def with_tier(
    spec: dict[str, Any],
    shape: Shape,
    model_dir: Path,
    cpu_bytes: int,
    root: Path,
    plugin_extra: dict[str, Any],
) -> tuple[dict[str, Any], Path | None, float | None]:
    """(b): vLLM's tier of cpu_bytes; (c): an agent-made region of `kvshm layout`'s size."""
    if spec["tier"] == "a":
        return spec, None, None
    document = region_layout(model_dir, spec["engine_id"], cpu_bytes)
    spec["cpu_bytes"] = region_bytes(document)
    if spec["tier"] == "b":
        return spec, None, None
    directory, seconds = agent_region(document, root)
    spec["region_dir"] = str(directory)
    spec["plugin_extra"] = plugin_extra
    return spec, directory, seconds


def workloads(args: argparse.Namespace) -> list[dict[str, Any]]:
    q = args.scale
    return [
        {
            "kind": "prefix_repetition",
            "prefixes": 5,
            "prefix_tokens": args.prefix_tokens,
            "requests": 10 * q,
            "suffix_tokens": 256,
            "max_tokens": 32,
            "concurrency": 2,
        },
        {
            "kind": "multi_turn",
            "conversations": 8 * q,
            "turns": 3,
            "first_tokens": 8192,
            "turn_tokens": 512,
            "max_tokens": 64,
            "concurrency": 4,
        },
        {
            "kind": "zero_reuse",
            "requests": 8 * q,
            "prompt_tokens": 4096,
            "max_tokens": 64,
            "concurrency": 4,
        },
    ]


def bench(args: argparse.Namespace, work: Path, log: Path) -> list[dict[str, Any]]:
    results = []
    plugin_extra: dict[str, Any] = {}  # dummy weights identify themselves: warm restart on
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        model_dir = shape.write(work / "models" / shape.name)
        for n, tier in enumerate(args.configs.split(",")):
            spec = base_spec(args, shape, model_dir, tier, f"{shape.name}-{tier}{n}")
            spec, region, agent_s = with_tier(
                spec, shape, model_dir, int(args.cpu_gib * GIB), Path(args.root), plugin_extra
            )
            spec["link"] = n == 0
            spec["probe"] = {
                "prefix_tokens": args.prefix_tokens,
                "prefixes": args.probe_prefixes,
                "repeats": 2,
            }
            chosen = args.workloads.split(",") if args.workloads else []
            spec["workloads"] = [w for w in workloads(args) if w["kind"] in chosen]
            result = run_engine(spec, work, log, args.timeout)
            result["agent_s"] = agent_s
            results.append(result)
            if region is not None:
                shutil.rmtree(region, ignore_errors=True)
            remove_vllm_region(spec["engine_id"])
    return results


def startup(args: argparse.Namespace, work: Path, log: Path) -> list[dict[str, Any]]:
    """Engine start with a large tier: vLLM creating its own against kvshm attaching the
    agent's populated region. A first engine warms the disk caches (Triton's, the plugin's
    backend choices) for both; then (b), (c), (b), (c), each a fresh process."""
    shape = SHAPES[args.shapes.split(",")[0]]
    model_dir = shape.write(work / "models" / shape.name)
    results = []
    order = ["c", "b", "c", "b", "c"] if args.startup_repeats > 1 else ["c", "b", "c"]
    for n, tier in enumerate(order):
        spec = base_spec(args, shape, model_dir, tier, f"startup-{tier}{n}")
        spec, region, agent_s = with_tier(
            spec,
            shape,
            model_dir,
            int(args.startup_gib * GIB),
            Path(args.root),
            {},
        )
        spec |= {"warmup": False, "first_request": 2048, "workloads": []}
        result = run_engine(spec, work, log, args.timeout)
        result["agent_s"] = agent_s
        result["warming"] = n == 0
        results.append(result)
        if region is not None:
            shutil.rmtree(region, ignore_errors=True)
        remove_vllm_region(spec["engine_id"])
    return results


def resident_keys(region: Path, instance_id: str, chunks: int) -> list[str]:
    """The chunks the index says are stored and resident, read from a copy (opening an index
    locks and may rewrite it; the copy keeps the original as the dead engine left it)."""
    from kvshm.region.index.format import parse_header
    from kvshm.region.index.writer import RegionIndex
    from kvshm.region.naming import index_file_name

    copy = Path(tempfile.mkdtemp(prefix="kvshm-index-"))
    shutil.copy2(region / index_file_name(instance_id), copy / index_file_name(instance_id))
    index = RegionIndex.open(str(copy), instance_id, chunks, create=False)
    try:
        header = parse_header(bytes(Path(index.path).read_bytes()[:4096]))
        if header.identity is None:
            return []
        return [record.key.hex() for record in index.adopt(header.identity).records]
    finally:
        index.close()
        shutil.rmtree(copy, ignore_errors=True)


def read_progress(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = []
    for text in path.read_text().splitlines():
        try:
            lines.append(json.loads(text))
        except json.JSONDecodeError:
            break  # a line the kill cut short
    return lines


def restart(args: argparse.Namespace, work: Path, log: Path) -> dict[str, Any]:
    """Serve, SIGKILL the engine at a random moment, start a new engine process of the same
    identity on the same region and replay the same requests."""
    shape = SHAPES[args.shapes.split(",")[0]]
    model_dir = shape.write(work / "models" / shape.name)
    rng = random.Random(args.seed)
    spec = base_spec(args, shape, model_dir, "c", "restart-first")
    extra: dict[str, Any] = {}
    spec, region, _ = with_tier(
        spec, shape, model_dir, int(args.cpu_gib * GIB), Path(args.root), extra
    )
    assert region is not None
    chunks = spec["cpu_bytes"] // shape.kv_bytes_per_block
    progress = work / "restart-progress-first.jsonl"
    workload = {
        "prefixes": 8,
        "prefix_tokens": args.prefix_tokens // 2,
        "requests": 400,
        "suffix_tokens": 256,
        "max_tokens": 16,
        "concurrency": 1,
    }
    spec |= {
        "warmup": False,  # every chunk it stores is one the replay asks for again
        "workloads": [],
        "restart": {"phase": "first", "progress": str(progress), "workload": workload},
    }
    spec_path = work / "restart-first.spec.json"
    spec_path.write_text(json.dumps(spec))
    print(f"== restart: first engine on {region}", flush=True)
    with open(log, "a") as out:
        first = subprocess.Popen(
            [sys.executable, str(ENGINE), str(spec_path), str(work / "x.json")],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=python_env(),
        )
        deadline = time.monotonic() + args.timeout
        wanted = workload["prefixes"] + 2 + rng.randrange(0, 6)  # each prefix, then tier hits
        while len(read_progress(progress)) < wanted and first.poll() is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        delay = rng.uniform(0.0, 1.5)
        time.sleep(delay)
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    served = read_progress(progress)
    resident = resident_keys(region, spec["engine_id"], chunks)
    print(
        f"   killed after {len(served)} requests (+{delay:.2f}s); the index holds "
        f"{len(resident)} resident chunks",
        flush=True,
    )
    second_progress = work / "restart-progress-second.jsonl"
    second = dict(spec)
    second["label"] = "restart-second"
    second["warmup"] = False  # its first request is the replay's
    second["restart"] = {
        "phase": "second",
        "progress": str(second_progress),
        "workload": workload | {"requests": len(served) + 1},
    }
    result = run_engine(second, work, log, args.timeout)
    replay = read_progress(second_progress)
    loaded = set(result.get("restart", {}).get("loaded_keys", []))
    hit = [k for k in resident if k in loaded]
    equal = [a["output"] == b["output"] for a, b in zip(served, replay, strict=False)]
    tier_hits_before = [s["ttft"] for s in served if s["external_tokens"] > 0]
    from kvshm.region.index.reader import read_outcome

    dir_fd = os.open(region, os.O_RDONLY | os.O_DIRECTORY)
    try:
        outcome = read_outcome(dir_fd, spec["engine_id"], str(region)).outcome
    finally:
        os.close(dir_fd)
    shutil.rmtree(region, ignore_errors=True)
    return {
        "killed_after_requests": len(served),
        "kill_delay_s": delay,
        "resident_chunks": len(resident),
        "resident_keys": resident,
        "resident_hit": len(hit),
        "resident_hit_fraction": len(hit) / len(resident) if resident else None,
        "second_outcome": None if outcome is None else dataclasses.asdict(outcome),
        "outputs_compared": len(equal),
        "outputs_equal": all(equal) and len(equal) == len(served),
        "first_ttft_after_restart": replay[0]["ttft"] if replay else None,
        "first_external_tokens_after_restart": replay[0]["external_tokens"] if replay else None,
        "tier_hit_ttft_before_kill": tier_hits_before,
        "ok": result.get("ok"),
        "error": result.get("error"),
        "second": {k: v for k, v in result.items() if k != "restart"},
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="llama-3.1-8b")
    parser.add_argument("--configs", default="a,b,c")
    parser.add_argument("--layout", default=None, help="VLLM_KV_CACHE_LAYOUT, e.g. BLHNC")
    parser.add_argument("--gpu-kv-gib", type=float, default=6.0)
    parser.add_argument("--cpu-gib", type=float, default=16.0)
    parser.add_argument("--prefix-tokens", type=int, default=16384)
    parser.add_argument("--probe-prefixes", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=40960)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument(
        "--workloads",
        default="prefix_repetition,multi_turn,zero_reuse",
        help="comma-separated workloads after the hit probe ('' for none)",
    )
    parser.add_argument("--startup-gib", type=float, default=0.0)
    parser.add_argument("--startup-repeats", type=int, default=1)
    parser.add_argument("--restart", action="store_true")
    parser.add_argument("--skip-bench", action="store_true")
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--root", default="/dev/shm/kvshm-engine-bench")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per engine process")
    parser.add_argument("--out", default=os.environ.get("OUT") or "engine-bench-out")
    parser.add_argument("--dry", action="store_true", help="no engine: check the plumbing")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvshm-engine-bench-"))
    log = out / "engine.log"
    report: dict[str, Any] = {"args": vars(args), "started": time.time()}
    if args.dry:
        report["dry"] = dry(args, work)
    else:
        if not args.skip_bench:
            report["bench"] = bench(args, work, log)
            (out / "results.json").write_text(json.dumps(report, indent=1))
            print_report(
                {"bench": report["bench"]}
            )  # the tables so far, should a later part not end
        if args.restart:
            report["restart"] = restart(args, work, log)
            (out / "results.json").write_text(json.dumps(report, indent=1))
        if args.startup_gib:
            report["startup"] = startup(args, work, log)
    (out / "results.json").write_text(json.dumps(report, indent=1))
    print_report({k: v for k, v in report.items() if k != "bench"})
    return 0


def dry(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """The plumbing without an engine: sizes, the agent's region, the specs and workloads."""
    from bench.engine.engine import build_workloads, engine_kwargs, kv_transfer_config

    shape = SHAPES[args.shapes.split(",")[0]]
    model_dir = shape.write(work / "models" / shape.name)
    made = {}
    for tier in ("a", "b", "c"):
        spec = base_spec(args, shape, model_dir, tier, f"dry-{tier}")
        spec, region, agent_s = with_tier(
            spec,
            shape,
            model_dir,
            int(args.cpu_gib * GIB),
            Path(args.root),
            {"kvshm_model_revision": "x"},
        )
        spec["workloads"] = workloads(args)
        loads = build_workloads(spec, shape)
        made[tier] = {
            "kwargs": {k: v for k, v in engine_kwargs(spec, str(model_dir)).items()},
            "transfer": kv_transfer_config(spec),
            "region": str(region),
            "agent_s": agent_s,
            "workloads": [
                (w.name, len(w.conversations), w.prompt_tokens_first_turns) for w in loads
            ],
        }
        if region is not None:
            shutil.rmtree(region, ignore_errors=True)
    print(json.dumps(made, indent=1, default=str))
    return made


if __name__ == "__main__":
    sys.exit(main())
