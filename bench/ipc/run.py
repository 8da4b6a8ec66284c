"""kvshm.ipc MessageQueue against multiprocessing.Queue (one queue per reader), same run.

    .venv/bin/python bench/ipc/run.py [--quick] [--repeat 3] [--cases 64x1,16Mx4,...]

The writer and every reader are separate processes (spawned). Each case runs both
implementations twice: a throughput run (the writer sends as fast as it can; messages/s is
broadcast messages per second, each delivered to every reader, timed from the start until the
last reader has the last message) and a latency run (the writer sends one message, then
sleeps a gap; latency is receive time minus send time, both CLOCK_MONOTONIC, over all
readers; the gap is the case's, or twice the slower implementation's time per message if
that is longer, so latency never includes waiting behind earlier messages). Messages are
(sequence, send time, bytes payload of the case's size).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvshm.ipc import FENCE_KIND, MessageQueue, RingHandle

KIB, MIB = 1 << 10, 1 << 20
CTX = mp.get_context("spawn")


@dataclass(frozen=True)
class Case:
    size: int
    readers: int
    throughput_messages: int
    latency_messages: int
    latency_gap_s: float
    chunk_bytes: int
    chunks: int

    @property
    def label(self) -> str:
        size = f"{self.size // MIB} MiB" if self.size >= MIB else f"{self.size} B"
        if KIB <= self.size < MIB:
            size = f"{self.size // KIB} KiB"
        return f"{size} x{self.readers}"


def make_cases(quick: bool) -> list[Case]:
    """Per size: (throughput messages, latency messages, latency gap, chunk bytes, chunks)."""
    scale = 5 if quick else 1
    plans = [
        (64, 100_000, 4000, 0.0005, 4 * KIB, 1024),
        (KIB, 100_000, 4000, 0.0005, 4 * KIB, 1024),
        (MIB, 2000, 400, 0.002, MIB + 4 * KIB, 16),
        (16 * MIB, 120, 60, 0.02, 16 * MIB + 4 * KIB, 4),
    ]
    return [
        Case(size, readers, throughput // scale, latency // scale, gap, chunk_bytes, chunks)
        for readers in (1, 4)
        for size, throughput, latency, gap, chunk_bytes, chunks in plans
    ]


def payload(size: int) -> bytes:
    return bytes(range(256)) * (size // 256) + bytes(size % 256)


# -- kvshm.ipc ------------------------------------------------------------------------------


def receive_all(get: Callable[..., Any], count: int, barrier: Any, results: Any) -> None:
    """The readers' loop, the same for both implementations: latency of every message, and
    the time the last one arrived."""
    barrier.wait()
    latencies = []
    for _ in range(count):
        _, sent, _ = get(timeout=60)
        latencies.append(time.perf_counter() - sent)
    results.put((time.perf_counter(), latencies))


def kvshm_reader(handle: RingHandle, count: int, barrier: Any, results: Any) -> None:
    queue = MessageQueue.create_from_handle(handle)
    queue.wait_until_ready(timeout=30)
    receive_all(queue.dequeue, count, barrier, results)
    queue.close()


def kvshm_writer(case: Case, count: int, gap: float, barrier: Any, handles: Any) -> None:
    queue = MessageQueue(case.readers, case.chunk_bytes, case.chunks)
    handles.put(queue.export_handle())
    queue.wait_until_ready(timeout=30)
    data = payload(case.size)
    barrier.wait()
    handles.put(time.perf_counter())
    for seq in range(count):
        queue.enqueue((seq, time.perf_counter(), data), timeout=60)
        if gap:
            time.sleep(gap)
    # the ring goes when the creator closes: wait until the readers are done with it
    handles.get(timeout=600)
    queue.close()


def run_kvshm(case: Case, count: int, gap: float) -> tuple[float, list[float]]:
    barrier = CTX.Barrier(1 + case.readers)
    handles, results = CTX.Queue(), CTX.Queue()
    writer = CTX.Process(target=kvshm_writer, args=(case, count, gap, barrier, handles))
    writer.start()
    handle = handles.get(timeout=60)
    readers = [
        CTX.Process(target=kvshm_reader, args=(handle, count, barrier, results))
        for _ in range(case.readers)
    ]
    for reader in readers:
        reader.start()
    started = handles.get(timeout=120)
    outcomes = [results.get(timeout=600) for _ in readers]
    handles.put("done")
    for process in (*readers, writer):
        process.join(60)
    return summarize(started, outcomes)


# -- the baseline: multiprocessing.Queue, one per reader -------------------------------------


def mp_reader(queue: Any, count: int, barrier: Any, results: Any) -> None:
    receive_all(queue.get, count, barrier, results)


def mp_writer(
    queues: list[Any], size: int, count: int, gap: float, barrier: Any, started: Any
) -> None:
    data = payload(size)
    barrier.wait()
    started.put(time.perf_counter())
    for seq in range(count):
        message = (seq, time.perf_counter(), data)
        for queue in queues:
            queue.put(message)
        if gap:
            time.sleep(gap)
    for queue in queues:
        queue.close()
        queue.join_thread()


def run_mp(case: Case, count: int, gap: float) -> tuple[float, list[float]]:
    barrier = CTX.Barrier(1 + case.readers)
    queues = [CTX.Queue() for _ in range(case.readers)]
    started, results = CTX.Queue(), CTX.Queue()
    readers = [
        CTX.Process(target=mp_reader, args=(queue, count, barrier, results)) for queue in queues
    ]
    writer = CTX.Process(target=mp_writer, args=(queues, case.size, count, gap, barrier, started))
    for process in (*readers, writer):
        process.start()
    begin = started.get(timeout=120)
    outcomes = [results.get(timeout=600) for _ in readers]
    for process in (*readers, writer):
        process.join(60)
    return summarize(begin, outcomes)


def summarize(
    started: float, outcomes: list[tuple[float, list[float]]]
) -> tuple[float, list[float]]:
    finished = max(done for done, _ in outcomes)
    latencies = [value for _, values in outcomes for value in values]
    return finished - started, latencies


# -- report ------------------------------------------------------------------------------------


@dataclass
class Result:
    messages_per_s: float
    bytes_per_s: float
    p50_us: float
    p99_us: float


def one_round(case: Case, runs: list[Any]) -> list[Result]:
    """Throughput of each implementation, then latency of each, paced the same for all and
    slower than the slowest one's service time, so that no message waits behind another."""
    rates = [case.throughput_messages / run(case, case.throughput_messages, 0.0)[0] for run in runs]
    gap = max(case.latency_gap_s, 2.0 / min(rates))
    results = []
    for run, rate in zip(runs, rates, strict=True):
        _, latencies = run(case, case.latency_messages, gap)
        latencies.sort()
        results.append(
            Result(
                rate,
                rate * case.size,
                statistics.median(latencies) * 1e6,
                latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e6,
            )
        )
    return results


@dataclass
class Comparison:
    base: Result  # medians over the rounds
    ours: Result
    rate_ratios: list[float]  # ours / base, per round (both measured back to back)
    p50_ratios: list[float]


def measure(case: Case, repeats: int) -> Comparison:
    """`repeats` rounds, the two implementations back to back in each: a shared machine's
    load changes between rounds, so ratios are taken within a round and then the median."""
    rounds = [one_round(case, [run_mp, run_kvshm]) for _ in range(repeats)]

    def median_result(which: int) -> Result:
        return Result(
            *(
                statistics.median(getattr(round_[which], field) for round_ in rounds)
                for field in ("messages_per_s", "bytes_per_s", "p50_us", "p99_us")
            )
        )

    return Comparison(
        median_result(0),
        median_result(1),
        [ours.messages_per_s / base.messages_per_s for base, ours in rounds],
        [ours.p50_us / base.p50_us for base, ours in rounds],
    )


# (size, readers): (minimum throughput ratio, maximum p50 ratio) set by the issue
GOALS: dict[tuple[int, int], tuple[float, float | None]] = {
    (64, 1): (1.5, 0.5),
    (64, 4): (2.0, None),
    (KIB, 4): (2.0, None),
    (16 * MIB, 1): (3.0, None),
    (16 * MIB, 4): (3.0, None),
}


def spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):5.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def verdict(case: Case, throughput_ratio: float, p50_ratio: float) -> str:
    goal = GOALS.get((case.size, case.readers))
    if goal is None:
        return ""
    least, most = goal
    met = throughput_ratio >= least and (most is None or p50_ratio <= most)
    wanted = f">={least}x rate" + ("" if most is None else f", <={most}x p50")
    return f"goal {wanted}: {'met' if met else 'MISSED'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the messages")
    parser.add_argument("--cases", help="comma-separated size x readers, e.g. 64x1,16Mx4")
    parser.add_argument("--repeat", type=int, default=3, help="rounds per case (median)")
    args = parser.parse_args()
    cases = make_cases(args.quick)
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [case for case in cases if spec(case) in wanted]
    print(
        f"nproc={os.cpu_count()} cpu={cpu_model()} python={platform.python_version()} "
        f"fence={FENCE_KIND}"
    )
    print(f"medians of {args.repeat} rounds; ratios: median (min-max) of the rounds' ratios")
    header = (
        f"{'case':>12} {'impl':>9} {'msgs/s':>10} {'MB/s':>9} {'p50 us':>9} {'p99 us':>9}"
        f" {'x msgs/s':>19} {'x p50':>19}  ring, goal"
    )
    print(header)
    for case in cases:
        comparison = measure(case, args.repeat)
        for name, result in (("mp.Queue", comparison.base), ("kvshm", comparison.ours)):
            line = (
                f"{case.label:>12} {name:>9} {result.messages_per_s:10.0f} "
                f"{result.bytes_per_s / 1e6:9.1f} {result.p50_us:9.1f} {result.p99_us:9.1f}"
            )
            if name == "kvshm":
                rate_ratio = statistics.median(comparison.rate_ratios)
                p50_ratio = statistics.median(comparison.p50_ratios)
                line += (
                    f" {spread(comparison.rate_ratios):>19} {spread(comparison.p50_ratios):>19}"
                    f"  {case.chunks}x{case.chunk_bytes} B  {verdict(case, rate_ratio, p50_ratio)}"
                )
            print(line, flush=True)


def spec(case: Case) -> str:
    size = f"{case.size // MIB}M" if case.size >= MIB else str(case.size)
    if KIB <= case.size < MIB:
        size = f"{case.size // KIB}K"
    return f"{size}x{case.readers}"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
