"""The engine benchmark's tables and ratios, from run.py's report (also on a saved
results.json: python3 bench/engine/report.py results.json)."""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from typing import Any

MS_FIELDS = ("itl_p50", "itl_p99", "decode_step_p50_transfers", "decode_step_p50_no_transfers")
TIERS = {"a": "(a) no tier", "b": "(b) vLLM's tier", "c": "(c) kvshm"}


def _f(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _row(*cells: Any) -> str:
    return " | ".join(str(c) for c in cells)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def probe_figures(result: dict[str, Any]) -> dict[str, Any]:
    rows = result.get("probe", {}).get("rows", [])
    cold = [r["cold"]["ttft"] for r in rows]
    gpu = [h["ttft"] for r in rows for h in r["gpu_hits"]]
    tier = [h["ttft"] for r in rows for h in r["tier_hits"]]
    loaded = [h["load_bytes"] for r in rows for h in r["tier_hits"]]
    external = [h["external_tokens"] for r in rows for h in r["tier_hits"]]
    return {
        "cold": cold,
        "gpu": gpu,
        "tier": tier,
        "load_bytes": _median([float(x) for x in loaded]),
        "external_tokens": _median([float(x) for x in external]),
        "outputs_equal": all(r.get("outputs_equal") for r in rows) if rows else None,
    }


def print_bench(results: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    by_shape: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in results:
        by_shape[
            r["spec"]["shape"]
            + (f" {r['spec']['kv_cache_layout']}" if r["spec"].get("kv_cache_layout") else "")
        ].append(r)
    for shape, runs in by_shape.items():
        device = next((r.get("device") for r in runs if r.get("device")), "?")
        link: dict[str, float] = next((r["link"] for r in runs if r.get("link")), {})
        lines.append(
            f"\n## {shape} on {device}; link H2D {_f(link.get('h2d_gbps'), 1)} GB/s, "
            f"D2H {_f(link.get('d2h_gbps'), 1)} GB/s"
        )
        lines.append(
            "config | ready s | cold TTFT | GPU-hit TTFT | after reset TTFT (tier hit) | "
            "external tokens | loaded MB | tokens equal"
        )
        probes: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in runs:
            tier = r["spec"]["tier"]
            if not r.get("ok"):
                lines.append(f"{TIERS[tier]} | FAILED: {str(r.get('error'))[-300:]}")
                continue
            p = probe_figures(r)
            probes[tier].append(p)
            lines.append(
                _row(
                    TIERS[tier],
                    _f(r.get("ready_s"), 1),
                    _spread(p["cold"]),
                    _spread(p["gpu"]),
                    _spread(p["tier"]),
                    _f(p["external_tokens"], 0),
                    _f((p["load_bytes"] or 0) / 1e6, 0),
                    p["outputs_equal"],
                )
            )
        b_tier = [t for p in probes.get("b", []) for t in p["tier"]]
        c_tier = [t for p in probes.get("c", []) for t in p["tier"]]
        c_gpu = [t for p in probes.get("c", []) for t in p["gpu"]]
        if c_tier and b_tier:
            ratio = statistics.median(c_tier) / statistics.median(b_tier)
            lines.append(f"tier-hit TTFT (c)/(b) = {ratio:.3f} (goal <= 1: {_met(ratio <= 1)})")
        if c_tier and c_gpu and link.get("h2d_gbps"):
            loaded = statistics.median(p["load_bytes"] or 0 for p in probes["c"])
            limit = statistics.median(c_gpu) + loaded / (link["h2d_gbps"] * 1e9)
            ratio = statistics.median(c_tier) / limit
            lines.append(
                f"tier-hit TTFT (c)/limit = {ratio:.3f}, limit {limit:.3f}s = GPU hit "
                f"{statistics.median(c_gpu):.3f}s + {loaded / 1e6:.0f} MB at the link "
                f"(goal <= 1.15: {'met' if ratio <= 1.15 else 'NOT met'})"
            )
        workloads: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(
            lambda: defaultdict(list)
        )
        for r in runs:
            for w in r.get("workloads", []):
                workloads[w["workload"]][r["spec"]["tier"]].append(w)
        for name, tiers in workloads.items():
            description = next(iter(tiers.values()))[0]["description"]
            lines.append(f"\n### {name}: {description}")
            lines.append(
                "config | s | req/s | out tok/s | total tok/s | TTFT p50 | TTFT p99 | "
                "ext hit rate | loaded GB | stored GB | ITL p50 ms | ITL p99 ms | "
                "decode step p50 ms with transfers / without (n)"
            )
            for tier, ws in sorted(tiers.items()):
                for w in ws:
                    moved = w["moved"]
                    ms = {k: _f((w[k] or 0) * 1e3, 1) for k in MS_FIELDS}
                    lines.append(
                        _row(
                            TIERS[tier],
                            f"{w['seconds']:.1f}",
                            f"{w['requests_per_s']:.3f}",
                            f"{w['output_tokens_per_s']:.1f}",
                            f"{w['total_tokens_per_s']:.0f}",
                            _f(w["ttft_p50"]),
                            _f(w["ttft_p99"]),
                            f"{w['external_hit_rate']:.3f}",
                            f"{moved['load_bytes'] / 1e9:.2f}",
                            f"{moved['store_bytes'] / 1e9:.2f}",
                            ms["itl_p50"],
                            ms["itl_p99"],
                            f"{ms['decode_step_p50_transfers']} / "
                            f"{ms['decode_step_p50_no_transfers']} "
                            f"({w['decode_steps_with_transfers']})",
                        )
                    )
            rate = {
                t: statistics.median(w["requests_per_s"] for w in ws) for t, ws in tiers.items()
            }
            if rate.get("c") and rate.get("a"):
                ca = rate["c"] / rate["a"]
                goal = "<= 3 % below (a)" if name == "zero_reuse" else ">= 2x (a)"
                met = ca >= 0.97 if name == "zero_reuse" else ca >= 2.0
                lines.append(
                    f"throughput (c)/(a) = {ca:.3f} (goal {goal}: {'met' if met else 'NOT met'})"
                )
            if rate.get("c") and rate.get("b"):
                cb = rate["c"] / rate["b"]
                lines.append(
                    f"throughput (c)/(b) = {cb:.3f} (goal >= 1: {'met' if cb >= 1 else 'NOT met'})"
                )
            outputs = {t: [w["outputs"] for w in ws] for t, ws in tiers.items()}
            if "a" in outputs:
                ref = outputs["a"][0]
                for t, outs in outputs.items():
                    same = all(o == ref for o in outs)
                    lines.append(f"outputs of {TIERS[t]} equal (a)'s: {same}")
    return lines


def print_startup(results: list[dict[str, Any]]) -> list[str]:
    lines = [
        "\n## engine start with a large CPU tier (fresh processes; the first warms the caches)",
        "config | warming | ready s | first request TTFT s | ready to first token s | agent s",
    ]
    ready: dict[str, list[float]] = defaultdict(list)
    for r in results:
        tier = r["spec"]["tier"]
        if not r.get("ok"):
            lines.append(f"{TIERS[tier]} | FAILED: {str(r.get('error'))[-300:]}")
            continue
        lines.append(
            f"{TIERS[tier]} | {r.get('warming')} | {_f(r.get('ready_s'), 2)} | "
            f"{_f(r.get('first_request_ttft'))} | {_f(r.get('ready_to_first_token_s'), 2)} | "
            f"{_f(r.get('agent_s'), 1)}"
        )
        if not r.get("warming"):
            ready[tier].append(r["ready_to_first_token_s"])
    if ready.get("b") and ready.get("c"):
        ratio = statistics.median(ready["b"]) / statistics.median(ready["c"])
        lines.append(
            f"start (b)/(c) = {ratio:.2f}x (goal >= 8x: {'met' if ratio >= 8 else 'NOT met'})"
        )
    return lines


def print_restart(r: dict[str, Any]) -> list[str]:
    lines = ["\n## restart: SIGKILL at a random moment, a new engine process on the same region"]
    before = r.get("tier_hit_ttft_before_kill") or []
    outcome = r.get("second_outcome") or {}
    fraction = r.get("resident_hit_fraction")
    lines.append(
        f"killed after {r.get('killed_after_requests')} requests "
        f"(+{_f(r.get('kill_delay_s'), 2)}s); resident chunks (index) {r.get('resident_chunks')}; "
        f"hit after restart {r.get('resident_hit')} = {_f(fraction, 4)} "
        f"(goal >= 0.99: {_met(fraction is not None and fraction >= 0.99)}); outputs equal: "
        f"{r.get('outputs_equal')} ({r.get('outputs_compared')} requests); second start: "
        f"{outcome.get('state')} {outcome.get('chunks')}"
    )
    first = r.get("first_ttft_after_restart")
    if first is not None and before:
        ratio = first / statistics.median(before)
        external = r.get("first_external_tokens_after_restart")
        lines.append(
            f"first request after restart TTFT {first:.3f}s ({external} external tokens) / tier "
            f"hit before the kill {statistics.median(before):.3f}s = {ratio:.2f} "
            f"(goal <= 1.2: {_met(ratio <= 1.2)})"
        )
    if r.get("error"):
        lines.append(f"second engine error: {str(r['error'])[-500:]}")
    return lines


def print_report(report: dict[str, Any]) -> None:
    lines: list[str] = []
    standins = next(
        (
            r.get("standins")
            for r in report.get("bench", []) + report.get("startup", [])
            if r.get("standins")
        ),
        None,
    )
    if standins:
        lines.append("stand-ins: " + "; ".join(standins))
    if report.get("bench"):
        lines += print_bench(report["bench"])
    if report.get("restart"):
        lines += print_restart(report["restart"])
    if report.get("startup"):
        lines += print_startup(report["startup"])
    print("\n".join(lines), flush=True)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", help="results.json of bench/engine/run.py")
    with open(parser.parse_args().results) as saved:
        print_report(json.load(saved))


if __name__ == "__main__":
    main()
