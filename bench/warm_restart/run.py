"""The warm-restart manager against vLLM 0.33's own CPUOffloadingManager, same run.

    .venv/bin/python bench/warm_restart/run.py
        [--chunks 20000]

Both managers get the same calls, as vLLM's offloading scheduler makes them (a request's chunk
keys with their positions, a lookup per key until the first miss, a load of the hits, a store
of the rest completed a step later, the request's end, the step's end), over more distinct keys
than the tier holds (evictions all the time). Each figure is the median over --rounds rounds,
the two managers' order alternating; per kind of call the thread's CPU time a key (time the
process waited for a core does not count), and kvshm's over vLLM's (goal: lookup and store
≤ 1.1×). Then the time a restarted manager's first call takes to
restore an index of N committed chunks (what "engine start to first hit" adds), and the
index's bytes per GiB of region for real rows. The index lives in --directory (a tmpfs).
--vllm-twice puts a second vLLM manager where kvshm's goes: the method's own spread (the
manager in that place tends to be charged more of the garbage collector's passes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from kvshm.region.index.format import index_size

GIB = 1 << 30
# rows of real regions (docs/warm-restart.md): vLLM's kv_bytes_per_chunk at block size 16, bf16
ROWS = {
    "Llama-3.1-8B TP1 (2 MiB rows)": 2 << 20,
    "Llama-3.1-70B TP4 (5 MiB rows)": 5 << 20,
    "Qwen2.5-7B TP1 (896 KiB rows)": 896 << 10,
    "the smallest row (4 KiB)": 4096,
}
KINDS = ("lookup", "store", "load", "finish", "step", "all")


@dataclass
class Request:
    keys: list[bytes]
    positions: list[int]


def workload(requests: int, chunks: int, seed: int) -> list[Request]:
    """Requests of 1-16 chunk keys from overlapping runs: prefixes shared, 3x the tier's
    chunks in distinct keys."""
    from vllm.v1.kv_offload.base import make_offload_key

    rng = random.Random(seed)
    spread = 3 * chunks
    made = []
    for _ in range(requests):
        first = rng.randrange(spread)
        count = rng.randrange(1, 17)
        keys = [
            make_offload_key(hashlib.sha256((first + i).to_bytes(8, "big")).digest(), 0)
            for i in range(count)
        ]
        made.append(Request(keys, [32 * (i + 1) for i in range(count)]))
    return made


@dataclass
class Timings:
    ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    keys: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))


class Driver:
    """One manager, driven request by request as vLLM's offloading scheduler drives it."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.timings = Timings()
        self.pending: list[tuple[list[bytes], Any]] = []

    def request(self, i: int, request: Request) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        clock = time.thread_time_ns  # CPU time: a busy machine's other processes do not count
        manager, ns, counted = self.manager, self.timings.ns, self.timings.keys
        keys = request.keys
        context = ReqContext(req_id=str(i))
        for key, position in zip(keys, request.positions, strict=True):
            context.set_offload_key_position(key, position)
        start = clock()
        manager.on_new_request(context)
        hits = 0
        for key in keys:
            if manager.lookup(key, context) is not LookupResult.HIT:
                break
            hits += 1
        looked = clock()
        ns["lookup"] += looked - start
        counted["lookup"] += min(hits + 1, len(keys))
        if hits:
            manager.prepare_load(keys[:hits], context)
            manager.complete_load(keys[:hits], context)
        loaded = clock()
        ns["load"] += loaded - looked
        counted["load"] += hits
        out = manager.prepare_store(keys[hits:], context)
        if self.pending:  # a store completes a step after it was prepared
            done, done_context = self.pending.pop(0)
            manager.complete_store(done, done_context)
        stored = clock()
        ns["store"] += stored - loaded
        counted["store"] += len(keys) - hits
        if out is not None and out.keys_to_store:
            self.pending.append((out.keys_to_store, context))
        manager.on_request_finished(context)
        finished = clock()
        ns["finish"] += finished - stored
        counted["finish"] += len(keys)
        manager.on_schedule_end(None)
        ns["step"] += clock() - finished
        counted["step"] += len(keys)

    def totals(self) -> Timings:
        ns, counted = self.timings.ns, self.timings.keys
        ns["all"] = sum(ns[kind] for kind in KINDS[:-1])
        counted["all"] = counted["finish"]
        return self.timings


def vllm_manager(chunks: int) -> Any:
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    return CPUOffloadingManager(chunks, "lru")


def kvshm_manager(chunks: int, directory: str, instance: str) -> Any:
    from kvshm.vllm.warm.manager import KvshmOffloadingManager, WarmStart

    return KvshmOffloadingManager(chunks, "lru", warm=WarmStart(directory, instance, {"b": 1}))


def first_call(manager: Any) -> float:
    """Seconds a manager's first call takes (a restarted kvshm manager restores there)."""
    from vllm.v1.kv_offload.base import ReqContext

    started = time.perf_counter()
    manager.lookup(b"\0" * 36, ReqContext(req_id="first"))
    return time.perf_counter() - started


def compare(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """Both managers in one loop, a request to one then the same request to the other (which
    goes first alternating), so a busy machine's noise falls on both alike."""
    requests = workload(args.requests, args.chunks, seed=34)
    per_key: dict[str, dict[str, list[float]]] = {"vllm": {}, "kvshm": {}}
    for round_ in range(args.rounds):
        instance = f"bench-{os.getpid()}-{round_}"
        theirs = vllm_manager(args.chunks)
        ours = (
            vllm_manager(args.chunks)
            if args.vllm_twice
            else kvshm_manager(args.chunks, directory, instance)
        )
        drivers = {"vllm": Driver(theirs), "kvshm": Driver(ours)}
        for driver in drivers.values():
            first_call(driver.manager)  # a new index: kvshm's restore is not measured here
        pair = list(drivers.values())
        for i, request in enumerate(requests):
            for driver in pair if i % 2 == 0 else reversed(pair):
                driver.request(i, request)
        for name, driver in drivers.items():
            driver.manager.shutdown()
            timings = driver.totals()
            for kind in KINDS:
                keys = max(1, timings.keys[kind])
                per_key[name].setdefault(kind, []).append(timings.ns[kind] / keys / 1000)
        if not args.vllm_twice:
            os.unlink(os.path.join(directory, f"vllm_offload_{instance}.index"))
    rows = []
    for kind in KINDS:
        ours = statistics.median(per_key["kvshm"][kind])
        theirs = statistics.median(per_key["vllm"][kind])
        rows.append({"kind": kind, "vllm_us": theirs, "kvshm_us": ours, "ratio": ours / theirs})
    return {"rows": rows, "rounds": per_key}


def restore(args: argparse.Namespace, directory: str) -> list[dict[str, float]]:
    """A restarted manager's first call against an index of N committed chunks."""
    from vllm.v1.kv_offload.base import ReqContext

    found = []
    for chunks in args.restore_chunks:
        instance = f"bench-restore-{os.getpid()}-{chunks}"
        manager = kvshm_manager(chunks, directory, instance)
        first_call(manager)
        keys = [k for r in workload(chunks // 8 + 1, chunks // 3, seed=1) for k in r.keys]
        keys = list(dict.fromkeys(keys))[:chunks]
        context = ReqContext(req_id="fill")
        out = manager.prepare_store(keys, context)
        manager.complete_store(out.keys_to_store, context)
        manager.on_schedule_end(None)
        manager.shutdown()
        again = kvshm_manager(chunks, directory, instance)
        seconds = first_call(again)
        restored = again.warm_outcome.chunks
        again.shutdown()
        theirs = first_call(vllm_manager(chunks))
        os.unlink(os.path.join(directory, f"vllm_offload_{instance}.index"))
        found.append(
            {"chunks": chunks, "restored": restored, "seconds": seconds, "vllm_seconds": theirs}
        )
    return found


def sizes() -> list[dict[str, Any]]:
    rows = []
    for name, row in ROWS.items():
        chunks = GIB // row
        rows.append({"region": name, "index_bytes_per_gib": index_size(chunks * 64) / 64})
    return rows


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, default=20_000, help="the CPU tier's chunks")
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--restore-chunks", type=int, nargs="*", default=[10_000, 100_000, 1_000_000]
    )
    parser.add_argument("--directory", default="/dev/shm", help="a tmpfs for the indexes")
    parser.add_argument(
        "--vllm-twice",
        action="store_true",
        help="vLLM's manager in kvshm's place too: the comparison's own spread",
    )
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    init_none_hash(sha256)  # as EngineCore does: the manager reads vLLM's seeded hashing
    directory = tempfile.mkdtemp(prefix="kvshm-bench-warm-", dir=args.directory)
    try:
        figures: dict[str, Any] = {
            "machine": f"{platform.node()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}",
            "chunks": args.chunks,
            "requests": args.requests,
        }
        figures["compare"] = compare(args, directory)
        figures["restore"] = restore(args, directory)
        figures["sizes"] = sizes()
    finally:
        os.rmdir(directory)
    print(f"{figures['machine']}; {args.chunks} chunks, {args.requests} requests")
    table(
        "µs a key, median of rounds (lookup: per key looked up; store: prepare + complete)",
        ["call", "vLLM", "kvshm", "kvshm/vLLM"],
        [
            [r["kind"], f"{r['vllm_us']:.2f}", f"{r['kvshm_us']:.2f}", f"{r['ratio']:.3f}"]
            for r in figures["compare"]["rows"]
        ],
    )
    table(
        "a restarted manager's first call (restore), against vLLM's first call",
        ["chunks", "restored", "kvshm s", "vLLM s"],
        [
            [
                str(r["chunks"]),
                str(r["restored"]),
                f"{r['seconds']:.4f}",
                f"{r['vllm_seconds']:.6f}",
            ]
            for r in figures["restore"]
        ],
    )
    table(
        "the index's size",
        ["region", "KiB per GiB"],
        [[r["region"], f"{r['index_bytes_per_gib'] / 1024:.1f}"] for r in figures["sizes"]],
    )
    ratios = {r["kind"]: r["ratio"] for r in figures["compare"]["rows"]}
    met = ratios["lookup"] <= 1.1 and ratios["store"] <= 1.1
    print(
        f"\ngoal lookup and store ≤ 1.1× vLLM's: {'met' if met else 'NOT met'} "
        f"(lookup {ratios['lookup']:.3f}, store {ratios['store']:.3f}, all {ratios['all']:.3f})"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
