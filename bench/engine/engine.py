"""One engine process of the engine benchmark: vLLM 0.33's offline engine (LLMEngine, the
stock scheduler, the V2 model runner, Triton attention, dummy weights, token-id prompts) with
(a) no CPU tier, (b) vLLM's own CPUOffloadingSpec or (c) kvshm's plugin on an agent-made
region; it serves the workloads it is given and writes what it measured as JSON.

    python3 bench/engine/engine.py SPEC.json RESULT.json

bench/engine/run.py writes the spec, starts one such process a configuration (a fresh process
each: nothing is shared but the disk caches) and reads the results.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path[:0] = [str(REPO)]

from bench.engine import standins  # noqa: E402
from bench.engine.shapes import BLOCK_SIZE, SHAPES, Shape  # noqa: E402
from bench.engine.workloads import (  # noqa: E402
    Conversation,
    Workload,
    multi_turn,
    prefix_repetition,
    zero_reuse,
)

# what vLLM's Python sources need on a machine without its compiled extensions (and are right
# for a benchmark anywhere): one process, no network, no FlashInfer sampler, the V2 runner
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_USE_FLASHINFER_SAMPLER": "0",
    "VLLM_TARGET_DEVICE": "cuda",
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "PYTHONHASHSEED": "0",
}
PLUGIN_SPEC = {"spec_name": "KvshmOffloadingSpec", "spec_module_path": "kvshm.vllm.spec"}


def kv_transfer_config(spec: dict[str, Any]) -> dict[str, Any] | None:
    """vLLM's --kv-transfer-config for the spec's configuration."""
    tier = spec["tier"]
    if tier == "a":
        return None
    extra: dict[str, Any] = {"cpu_bytes_to_use": spec["cpu_bytes"], "blocks_per_chunk": 1}
    if tier == "c":
        extra |= PLUGIN_SPEC | {"kvshm_region_dir": spec["region_dir"]}
        extra |= spec.get("plugin_extra", {})
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": spec["engine_id"],
        "kv_connector_extra_config": extra,
    }


def engine_kwargs(spec: dict[str, Any], model_dir: str) -> dict[str, Any]:
    """vLLM's LLM/EngineArgs keywords: eager, native IR ops, Triton attention, dummy weights."""
    kwargs: dict[str, Any] = {
        "model": model_dir,
        "load_format": "dummy",
        "dtype": "bfloat16",
        "seed": 0,
        "enforce_eager": True,
        "compilation_config": {"custom_ops": ["none"]},
        "kernel_config": {
            "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}
        },
        "attention_backend": "TRITON_ATTN",
        "skip_tokenizer_init": True,
        "kv_cache_memory_bytes": spec["gpu_kv_bytes"],
        "block_size": BLOCK_SIZE,
        "max_model_len": spec["max_model_len"],
        "enable_prefix_caching": True,
        "max_num_seqs": spec.get("max_num_seqs", 64),
        "max_num_batched_tokens": spec.get("max_num_batched_tokens", 8192),
    }
    transfer = kv_transfer_config(spec)
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    return kwargs


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass
class TransferTally:
    """What the engine's offloading worker moved, counted at its vLLM interface."""

    loads: int = 0
    stores: int = 0
    load_bytes: int = 0
    store_bytes: int = 0
    in_flight: int = 0
    load_ids: set[int] = field(default_factory=set)

    def snapshot(self) -> dict[str, int]:
        return {
            "loads": self.loads,
            "stores": self.stores,
            "load_bytes": self.load_bytes,
            "store_bytes": self.store_bytes,
        }


class Probes:
    """Counters around the engine's own objects (one process: UniProcExecutor): the scheduler
    connector's external matches per request, and the worker's transfers."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.core = engine.engine_core.engine_core
        self.scheduler = self.core.scheduler
        self.external: dict[str, int] = {}
        self.local: dict[str, int] = {}
        self.tally = TransferTally()
        self.worker: Any = None
        connector = getattr(self.scheduler, "connector", None)
        if connector is not None:
            self._wrap_matches(connector)
            self._wrap_worker()

    def _wrap_matches(self, connector: Any) -> None:
        original = connector.get_num_new_matched_tokens

        def matched(request: Any, num_computed_tokens: int) -> Any:
            result = original(request, num_computed_tokens)
            key = str(request.request_id).rsplit("-", 1)[0]
            if result[0] is not None:
                self.external[key] = max(self.external.get(key, 0), int(result[0]))
                self.local[key] = max(self.local.get(key, 0), int(num_computed_tokens))
            return result

        connector.get_num_new_matched_tokens = matched

    def _wrap_worker(self) -> None:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return
        worker = get_kv_transfer_group().connector_worker.worker
        self.worker = worker
        tally = self.tally
        submit_load, submit_store, get_finished = (
            worker.submit_load,
            worker.submit_store,
            worker.get_finished,
        )

        def load(job_id: int, *args: Any, **kwargs: Any) -> Any:
            tally.loads += 1
            tally.in_flight += 1
            tally.load_ids.add(job_id)
            return submit_load(job_id, *args, **kwargs)

        def store(job_id: int, *args: Any, **kwargs: Any) -> Any:
            tally.stores += 1
            tally.in_flight += 1
            return submit_store(job_id, *args, **kwargs)

        def finished() -> Any:
            results = get_finished()
            for result in results:
                tally.in_flight -= 1
                size = int(result.transfer_size or 0)
                if result.job_id in tally.load_ids:
                    tally.load_ids.discard(result.job_id)
                    tally.load_bytes += size
                else:
                    tally.store_bytes += size
            return results

        worker.submit_load, worker.submit_store, worker.get_finished = load, store, finished

    def busy(self) -> bool:
        return bool(self.scheduler.has_requests())


@dataclass
class RequestRecord:
    request_id: str
    conversation: Conversation
    turn: int
    prompt: list[int]
    submitted: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    output: list[int] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)


class Driver:
    """Serves conversations at a fixed concurrency through LLMEngine.add_request/step."""

    def __init__(self, engine: Any, probes: Probes) -> None:
        self.engine = engine
        self.probes = probes
        self.counter = 0
        self.on_finish: Callable[[RequestRecord], None] | None = None

    def params(self, max_tokens: int) -> Any:
        from vllm import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def submit(
        self, conversation: Conversation, turn: int, history: list[int]
    ) -> tuple[str, RequestRecord]:
        prompt = history + conversation.turns[turn]
        self.counter += 1
        request_id = f"{conversation.name}t{turn}n{self.counter}"
        record = RequestRecord(request_id, conversation, turn, prompt, time.perf_counter())
        self.engine.add_request(
            request_id, {"prompt_token_ids": prompt}, self.params(conversation.max_tokens)
        )
        return request_id, record

    def drain(self) -> None:
        """Step until the engine has nothing left, pending stores included."""
        while self.probes.busy():
            self.engine.step()

    def serve(self, workload: Workload) -> dict[str, Any]:
        # a stack of (conversation, turn, history): a conversation's next turn goes to the
        # bottom, behind every turn already waiting, so conversations interleave
        pending: list[tuple[Conversation, int, list[int]]] = [
            (c, 0, []) for c in reversed(workload.conversations)
        ]
        active: dict[str, RequestRecord] = {}
        done: list[RequestRecord] = []
        steps: list[tuple[float, bool, int]] = []
        tally = self.probes.tally
        before = tally.snapshot()
        start = time.perf_counter()
        while pending or active:
            while pending and len(active) < workload.concurrency:
                request_id, record = self.submit(*pending.pop())
                active[request_id] = record
            transfers = tally.in_flight > 0
            t0 = time.perf_counter()
            outputs = self.engine.step()
            t1 = time.perf_counter()
            decoding = 0
            for out in outputs:
                key = str(out.request_id)
                if key not in active:
                    key = key.rsplit("-", 1)[0]  # vLLM's internal id: ours and a suffix
                found = active.get(key)
                if found is None:
                    continue
                record = found
                tokens = list(out.outputs[0].token_ids)
                new = len(tokens) - record.tokens
                if new > 0:
                    if record.first is None:
                        record.first = t1
                    else:
                        decoding += 1
                        assert record.last is not None
                        record.gaps.append((t1 - record.last) / new)
                    record.last = t1
                    record.tokens = len(tokens)
                    record.output = tokens
                if out.finished:
                    done.append(record)
                    if self.on_finish is not None:
                        self.on_finish(record)
                    del active[key]
                    conversation = record.conversation
                    if record.turn + 1 < len(conversation.turns):
                        history = record.prompt + record.output
                        pending.insert(0, (conversation, record.turn + 1, history))
            steps.append((t1 - t0, transfers, decoding))
        elapsed = time.perf_counter() - start
        self.drain()
        after = tally.snapshot()
        return summarize(workload, done, steps, elapsed, before, after, self.probes)


def summarize(
    workload: Workload,
    done: list[RequestRecord],
    steps: list[tuple[float, bool, int]],
    elapsed: float,
    before: dict[str, int],
    after: dict[str, int],
    probes: Probes,
) -> dict[str, Any]:
    ttfts = [r.first - r.submitted for r in done if r.first is not None]
    gaps = [g for r in done for g in r.gaps]
    prompt_tokens = sum(len(r.prompt) for r in done)
    output_tokens = sum(r.tokens for r in done)
    names = [f"{r.conversation.name}t{r.turn}" for r in done]
    external = sum(probes.external.get(r.request_id, 0) for r in done)
    decode_steps = [s for s, _, decoding in steps if decoding]
    with_transfers = [s for s, transfers, decoding in steps if decoding and transfers]
    without = [s for s, transfers, decoding in steps if decoding and not transfers]
    return {
        "workload": workload.name,
        "description": workload.description,
        "requests": len(done),
        "seconds": elapsed,
        "requests_per_s": len(done) / elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "external_hit_tokens": external,
        "external_hit_rate": external / prompt_tokens if prompt_tokens else 0.0,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
        "ttft_mean": statistics.fmean(ttfts) if ttfts else None,
        "itl_p50": percentile(gaps, 0.5),
        "itl_p99": percentile(gaps, 0.99),
        "decode_step_p50": percentile(decode_steps, 0.5),
        "decode_step_p50_transfers": percentile(with_transfers, 0.5),
        "decode_step_p50_no_transfers": percentile(without, 0.5),
        "decode_steps_with_transfers": len(with_transfers),
        "moved": {k: after[k] - before[k] for k in after},
        "outputs": {n: r.output for n, r in zip(names, done, strict=True)},
    }


def link_bandwidth(gib: float = 2.0, repeats: int = 5) -> dict[str, float]:
    """The link's GB/s one way, a pinned host buffer to and from the GPU (medians)."""
    import torch

    nbytes = int(gib * (1 << 30))
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    result: dict[str, float] = {}
    for name, dst, src in (("h2d", device, host), ("d2h", host, device)):
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        result[f"{name}_gbps"] = nbytes / statistics.median(times) / 1e9
    del host, device
    torch.cuda.empty_cache()
    return result


def single(driver: Driver, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    """One request alone: its TTFT, external hit tokens, bytes loaded and its output."""
    tally = driver.probes.tally
    before = tally.snapshot()
    conversation = Conversation(f"s{driver.counter + 1:05d}", [tokens], max_tokens)
    workload = Workload("single", [conversation], 1, "")
    result = driver.serve(workload)
    after = tally.snapshot()
    return {
        "ttft": result["ttft_p50"],
        "external_tokens": result["external_hit_tokens"],
        "load_bytes": after["load_bytes"] - before["load_bytes"],
        "output": next(iter(result["outputs"].values())),
    }


def hit_probe(
    driver: Driver, shape: Shape, prefix_tokens: int, prefixes: int, repeats: int
) -> dict[str, Any]:
    """Per prefix, interleaved: computed cold, a GPU prefix-cache hit, then `repeats` times the
    GPU cache reset and the prompt again (a CPU-tier hit where there is a tier, computed cold
    again where there is none), each followed by a GPU hit."""
    import random

    rng = random.Random(7)
    rows = []
    for p in range(prefixes):
        tokens = [rng.randrange(1000, shape.vocab - 1000) for _ in range(prefix_tokens)]
        row: dict[str, Any] = {"cold": single(driver, tokens, 8)}
        row["gpu_hits"] = [single(driver, tokens, 8)]
        row["tier_hits"] = []
        for _ in range(repeats):
            if not driver.engine.reset_prefix_cache():
                raise RuntimeError("reset_prefix_cache refused")
            row["tier_hits"].append(single(driver, tokens, 8))
            row["gpu_hits"].append(single(driver, tokens, 8))
        outputs = [row["cold"]["output"]] + [
            h["output"] for h in row["tier_hits"] + row["gpu_hits"]
        ]
        row["outputs_equal"] = all(o == outputs[0] for o in outputs)
        row["output"] = row["cold"].pop("output")
        for hit in row["tier_hits"] + row["gpu_hits"]:
            hit.pop("output")
        rows.append(row)
        print(
            f"  probe prefix {p}: cold {row['cold']['ttft']:.3f}s, GPU hit "
            f"{statistics.median(h['ttft'] for h in row['gpu_hits']):.3f}s, after reset "
            f"{statistics.median(h['ttft'] for h in row['tier_hits']):.3f}s "
            f"(external {row['tier_hits'][0]['external_tokens']} tokens)",
            flush=True,
        )
    return {"prefix_tokens": prefix_tokens, "rows": rows}


def build_workloads(spec: dict[str, Any], shape: Shape) -> list[Workload]:
    vocab = shape.vocab
    made: dict[str, Callable[[dict[str, Any]], Workload]] = {
        "prefix_repetition": lambda w: prefix_repetition(vocab=vocab, **w),
        "multi_turn": lambda w: multi_turn(vocab=vocab, **w),
        "zero_reuse": lambda w: zero_reuse(vocab=vocab, **w),
    }
    return [made[w.pop("kind")](w) for w in (dict(x) for x in spec.get("workloads", []))]


def restart_phase(driver: Driver, restart: dict[str, Any], shape: Shape) -> dict[str, Any]:
    """Serve the restart workload, writing each finished request (its TTFT, external hit
    tokens and output) to the progress file as it finishes, so what a SIGKILLed engine served
    survives it; the second engine also records every key its manager was asked to load."""
    workload = prefix_repetition(vocab=shape.vocab, **restart["workload"])
    progress = open(restart["progress"], "a")  # noqa: SIM115 (open until the process ends)
    probes = driver.probes

    def finished(record: RequestRecord) -> None:
        ttft = None if record.first is None else record.first - record.submitted
        line = {
            "name": f"{record.conversation.name}t{record.turn}",
            "ttft": ttft,
            "external_tokens": probes.external.get(record.request_id, 0),
            "local_tokens": probes.local.get(record.request_id, 0),
            "output": record.output,
        }
        progress.write(json.dumps(line) + "\n")
        progress.flush()

    driver.on_finish = finished
    loaded: list[str] = []
    manager = probes.scheduler.connector.connector_scheduler.manager
    prepare_load = manager.prepare_load

    def recording(keys: Any, *args: Any, **kwargs: Any) -> Any:
        loaded.extend(bytes(k).hex() for k in keys)
        return prepare_load(keys, *args, **kwargs)

    manager.prepare_load = recording
    if restart["phase"] == "first":
        print("  restart: serving until killed", flush=True)
    summary = driver.serve(workload)
    summary.pop("outputs")
    return {"summary": summary, "loaded_keys": loaded}


def plugin_facts(probes: Probes) -> dict[str, Any] | None:
    """What kvshm's scheduler side found on the engine's real path: whether warm restart got
    vLLM's config and identified the weights (its outcome), and how the index started."""
    connector = getattr(probes.scheduler, "connector", None)
    manager = getattr(getattr(connector, "connector_scheduler", None), "manager", None)
    if manager is None or not hasattr(manager, "warm_outcome"):
        return None
    outcome = manager.warm_outcome
    return {"warm_outcome": None if outcome is None else dataclasses.asdict(outcome)}


def serve_until_drained(driver: Driver, shape: Shape, seconds: float) -> dict[str, Any]:
    """Serve new prompts one after another (each stored to the tier) until the engine fails or
    `seconds` pass; the plugin fails the engine at the first transfer after a drain."""
    import random

    rng = random.Random(11)
    served = 0
    print("  drain: serving", flush=True)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        tokens = [rng.randrange(1000, shape.vocab - 1000) for _ in range(1024)]
        try:
            single(driver, tokens, 4)
        except Exception as exc:  # the engine's end: what ended it is the finding
            return {"served": served, "error": f"{type(exc).__name__}: {exc}"}
        served += 1
    return {"served": served, "error": None}


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", help="the configuration, as bench/engine/run.py writes it")
    parser.add_argument("result", help="where the measurements go (JSON)")
    args = parser.parse_args(argv)
    spec_path, result_path = args.spec, args.result
    spec = json.loads(Path(spec_path).read_text())
    os.environ.update(ENGINE_ENV)
    if spec.get("kv_cache_layout"):
        os.environ["VLLM_KV_CACHE_LAYOUT"] = spec["kv_cache_layout"]
    result: dict[str, Any] = {"spec": spec, "pid": os.getpid()}
    t_import = time.perf_counter()
    result["standins"] = standins.install()
    for line in result["standins"]:
        print(f"[stand-in] {line}", flush=True)
    import torch
    from vllm import LLM

    result["import_s"] = time.perf_counter() - t_import
    shape = SHAPES[spec["shape"]]
    model_dir = shape.write(Path(spec["model_dir"]))
    try:
        if spec.get("link"):
            result["link"] = link_bandwidth()
            print(f"  link: {result['link']}", flush=True)
        t0 = time.perf_counter()
        llm = LLM(**engine_kwargs(spec, str(model_dir)))
        result["ready_s"] = time.perf_counter() - t0
        print(f"  engine ready in {result['ready_s']:.2f}s", flush=True)
        engine = llm.llm_engine
        probes = Probes(engine)
        driver = Driver(engine, probes)
        result["device"] = torch.cuda.get_device_name()
        if spec.get("first_request"):
            # time to the first answer of a fresh engine: a short prompt stored then loaded
            first = single(driver, list(range(1000, 1000 + spec["first_request"])), 1)
            result["first_request_ttft"] = first["ttft"]
            result["ready_to_first_token_s"] = result["ready_s"] + first["ttft"]
        if spec.get("warmup", True):
            warm = [1000 + (i * 7919) % 50000 for i in range(2048)]
            single(driver, warm, 4)
            engine.reset_prefix_cache()
            single(driver, warm, 4)  # a tier's load path (and the plugin's calibration)
            engine.reset_prefix_cache()
        if spec.get("probe"):
            result["probe"] = hit_probe(driver, shape, **spec["probe"])
        result["workloads"] = []
        for workload in build_workloads(spec, shape):
            print(f"  workload {workload.description}", flush=True)
            engine.reset_prefix_cache()
            summary = driver.serve(workload)
            result["workloads"].append(summary)
            print(
                f"    {summary['seconds']:.1f}s, {summary['requests_per_s']:.3f} req/s, TTFT p50 "
                f"{summary['ttft_p50']:.3f}s p99 {summary['ttft_p99']:.3f}s, external hit rate "
                f"{summary['external_hit_rate']:.3f}, moved {summary['moved']}",
                flush=True,
            )
        if spec.get("serve_until_drained"):
            result["drain"] = serve_until_drained(driver, shape, spec["serve_until_drained"])
        if spec.get("restart"):
            result["restart"] = restart_phase(driver, spec["restart"], shape)
        result["plugin"] = plugin_facts(probes)
        result["ok"] = True
    except Exception:
        result["ok"] = False
        result["error"] = traceback.format_exc()
        print(result["error"], flush=True)
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0 if result["ok"] else 1)  # no teardown: the next configuration is a new process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
