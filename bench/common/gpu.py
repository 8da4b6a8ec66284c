"""What the GPU benchmarks share: units, timing from an idle GPU, the link's peak, and matrix
products standing in for a serving engine's compute (bench/transfer, bench/vllm_plugin)."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvshm.transfer.cuda.streams import own_stream

KIB, MIB, GIB = 1024, 1024**2, 1024**3


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def python_loop_ms() -> float:
    """Milliseconds a fixed pure-Python loop takes: how fast this process's CPU is now. On the
    lent H100 hosts it reads ~10 on a core of its own and up to ~20 when a neighbour shares the
    core (docs/transfer.md F29); submitting jobs slows alike."""
    started = time.perf_counter()
    total = 0
    for i in range(200_000):
        total += i * i
    return (time.perf_counter() - started) * 1e3


def median_seconds(run: Callable[[], float], reps: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        run()
    return statistics.median(run() for _ in range(reps))


def wall(issue: Callable[[], None]) -> float:
    """Seconds from an idle GPU to the end of everything `issue` queued."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    issue()
    torch.cuda.synchronize()
    return time.perf_counter() - started


def link_peak(reps: int) -> dict[str, float]:
    """GB/s of one 1 GiB contiguous pinned copy each way ("H2D", "D2H"), and of one each way at
    once ("both"): the link's peak that the benchmarks' goals are fractions of."""
    host = [torch.empty(GIB, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    for buffer in host:  # never time zeros
        buffer.view(torch.int64).copy_(torch.arange(GIB // 8, dtype=torch.int64))
    device = [torch.empty(GIB, dtype=torch.uint8, device="cuda") for _ in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]

    def h2d() -> None:
        with torch.cuda.stream(streams[0]):
            device[0].copy_(host[0], non_blocking=True)

    def d2h() -> None:
        with torch.cuda.stream(streams[1]):
            host[1].copy_(device[1], non_blocking=True)

    def both() -> None:
        h2d()
        d2h()

    return {
        "H2D": gbps(GIB, median_seconds(lambda: wall(h2d), reps)),
        "D2H": gbps(GIB, median_seconds(lambda: wall(d2h), reps)),
        "both": gbps(2 * GIB, median_seconds(lambda: wall(both), reps)),
    }


class Compute:
    """bf16 4096 x 4096 matrix products on their own stream, standing in for decode steps."""

    def __init__(self) -> None:
        self.a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        # not torch.cuda.Stream(): torch's 32 pooled streams are handed out in turn, and the
        # workers measured beside draw theirs from the same pool (kvshm.transfer.cuda.streams)
        self.stream = own_stream(torch.device("cuda"))
        # the first products on a stream also set up cuBLAS there (tens of ms): timed cold,
        # ms_each read 30x too long and products sized from it ended long before the transfer
        self.run(10)
        self.ms_each = self.run(50) / 50

    def start(self, count: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            for _ in range(count):
                torch.mm(self.a, self.a)
            end.record(self.stream)
        return start, end

    def run(self, count: int) -> float:
        """Milliseconds `count` products take alone."""
        start, end = self.start(count)
        end.synchronize()
        return float(start.elapsed_time(end))


@dataclass(frozen=True)
class Beside:
    """A transfer run beside matrix products: its GB/s, how many times as long the products
    took, and the milliseconds they lost per GB the transfer moved while they ran."""

    GBps: float
    slowdown: float
    delay_ms_per_gb: float
    delay_quartiles: tuple[float, float]
    """The pairs' first and third quartiles of the delay: the GPU's clock wanders, and two
    transfers by the same method differ by as much as this spread."""


def beside_compute(
    compute: Compute, nbytes: int, issue_and_wait: Callable[[], None], reps: int
) -> Beside:
    """The transfer beside products queued first on their own stream, each run paired with
    the same products alone just before it (the medians of `reps` pairs). The products are
    sized to outlast the transfer (1.5 times its time alone), so every byte moves while they
    run and the delay per GB compares transfers of any speed: a factor over products of a
    fixed length would credit a slow transfer with bytes it moved after they ended."""
    seconds = median_seconds(lambda: wall(issue_and_wait), 3, warmup=1)
    count = max(1, math.ceil(1.5 * seconds * 1e3 / compute.ms_each))
    rates, slowed, delays = [], [], []
    for _ in range(reps):
        alone = compute.run(count)
        torch.cuda.synchronize()
        start, end = compute.start(count)
        started = time.perf_counter()
        issue_and_wait()
        took = time.perf_counter() - started
        end.synchronize()
        beside = float(start.elapsed_time(end))
        moved = nbytes * min(1.0, beside / 1e3 / took)  # the bytes moved while they ran
        rates.append(gbps(nbytes, took))
        slowed.append(beside / alone)
        delays.append((beside - alone) / (moved / 1e9))
    first, _, third = statistics.quantiles(delays, n=4) if len(delays) > 1 else delays * 3
    return Beside(
        statistics.median(rates),
        statistics.median(slowed),
        statistics.median(delays),
        (first, third),
    )
