"""The calibration's policy, workload and timing runner (kvshm.transfer.calibration): which
backends a trial tries, how a choice is made of the times, what the trials move and how a
trial is judged. The plugin's use of it: tests/vllm_plugin/test_plugin_calibration.py."""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, cast

import pytest
import torch

from kvshm.transfer import TransferResult
from kvshm.transfer.calibration import measurement, policy, workload
from kvshm.transfer.calibration.policy import CHOICES


def test_copy_engines_tries_only_dma_and_the_strided_backend() -> None:
    every = ["dma", "kernel", "staged", "strided"]
    for pages in ([32 * 1024] * 64, [2 * 1024 * 1024]):
        assert policy.worth_trying(every, pages, True, sm_free=True) == ["dma", "strided"]
    assert policy.worth_trying(["cpu"], [4096], False, sm_free=True) == ["cpu"]


def test_scratch_blocks_lie_as_the_kv_cache_does() -> None:
    """Layer-outer views of one allocation (vLLM 0.33) get scratch views of one allocation,
    a pitch of their own blocks apart, so the strided backend is measured; else tensors."""
    backing = torch.zeros((3, 10, 64), dtype=torch.int8)
    one = list(backing)
    assert workload.one_allocation_pitch(one) == 640
    scratch = workload.scratch_tensors(one)
    blocks = scratch[0].shape[0]
    assert [t.shape for t in scratch] == [torch.Size([blocks, 64])] * 3
    assert workload.one_allocation_pitch(scratch) == blocks * 64
    apart = [torch.zeros((10, 64), dtype=torch.int8) for _ in range(3)]
    assert workload.one_allocation_pitch(apart) is None
    scratch = workload.scratch_tensors(apart)
    assert len({t.untyped_storage().data_ptr() for t in scratch}) == 3
    assert workload.one_allocation_pitch([backing[0], backing[1], backing[2][:5]]) is None
    assert workload.one_allocation_pitch([backing[0], backing[2], backing[1]]) is None
    assert workload.one_allocation_pitch([backing[0]]) is None
    rows = backing.view(3, 640)
    halves = [rows[0, :320].view(5, 64), rows[0, 320:].view(5, 64), rows[2, :320].view(5, 64)]
    assert workload.one_allocation_pitch(halves) is None  # uneven steps


def test_one_way_and_both_ways_each_get_their_fastest_backends() -> None:
    # DMA wins each direction alone; staging wins both ways at once (one thread issuing both
    # directions' descriptors), as on the H200 host of docs/transfer.md F17
    measured = measurement.Measurement(
        alone={
            "store": {"dma": 1.00, "staged": 1.06, "kernel": 1.10},
            "load": {"dma": 1.00, "staged": 1.05, "kernel": 1.20},
        },
        both={
            ("dma", "dma"): 1.50,
            ("dma", "staged"): 1.30,
            ("staged", "dma"): 1.30,
            ("staged", "staged"): 1.10,
            ("kernel", "kernel"): 1.60,
        },
        policy={"store": "staged", "load": "staged"},
    )
    assert measured.choice() == {
        "store": "dma",
        "load": "dma",
        "store_beside": "staged",
        "load_beside": "staged",
    }


def test_the_policy_pick_stays_unless_clearly_beaten() -> None:
    within = measurement.Measurement(
        alone={"store": {"kernel": 1.00, "staged": 1.02}, "load": {"staged": 1.0}},
        both={("kernel", "staged"): 1.00, ("staged", "staged"): 1.025},
        policy={"store": "staged", "load": "staged"},
    )
    assert within.choice() == dict.fromkeys(CHOICES, "staged")
    beaten = dataclasses.replace(
        within,
        alone={"store": {"kernel": 1.00, "staged": 1.15}, "load": {"staged": 1.0}},
        both={("kernel", "staged"): 1.00, ("staged", "staged"): 1.15},
    )
    assert beaten.choice() == {
        "store": "kernel",
        "load": "staged",
        "store_beside": "kernel",
        "load_beside": "staged",
    }
    # a rank that never stores chooses its loads alone
    loads_only = measurement.Measurement(alone={"load": {"dma": 1.0, "kernel": 2.0}}, both={})
    assert loads_only.choice() == {"load": "dma"}


def test_the_copy_kernel_must_win_by_more_than_its_margin() -> None:
    """It holds SMs for the whole copy (the products lost ~10x what they lose beside
    staging): a lead the trial barely tells is not worth that."""
    measured = measurement.Measurement(
        alone={
            "store": {"dma": 2.0, "kernel": 1.00, "staged": 1.06},
            "load": {"dma": 2.0, "kernel": 1.00, "staged": 1.12},
        },
        both={("kernel", "kernel"): 1.00, ("staged", "staged"): 1.08, ("dma", "dma"): 3.0},
        policy={"store": "staged", "load": "staged"},
    )
    assert measured.choice() == {
        "store": "staged",  # 6 % behind the kernel: within its margin
        "load": "kernel",  # 12 % behind: beyond it
        "store_beside": "staged",
        "load_beside": "staged",
    }
    kernel_only = measurement.Measurement(alone={"load": {"kernel": 1.0}}, both={})
    assert kernel_only.choice() == {"load": "kernel"}


def test_a_tie_goes_to_the_backend_that_takes_the_least_of_the_engine() -> None:
    """Within MARGIN the measurement cannot tell. The copy engines leave the engine's SMs alone
    (docs/transfer.md F9), so DMA wins a tie, one way and both ways; what DMA's issuing takes
    of the engine's thread is in the judged times themselves."""
    tied = measurement.Measurement(
        alone={"store": {"dma": 1.02, "staged": 1.0}, "load": {"dma": 1.0, "staged": 0.99}},
        both={("dma", "dma"): 1.025, ("staged", "dma"): 1.0, ("staged", "staged"): 1.01},
        policy={"store": "staged", "load": "staged"},
    )
    assert tied.choice() == dict.fromkeys(CHOICES, "dma")
    # ...between backends that take the SMs alike, the policy's pick
    staged_pairs = dataclasses.replace(
        tied, both={("staged", "staged"): 1.01, ("kernel", "kernel"): 1.0}
    )
    assert staged_pairs.choice()["store_beside"] == "staged"
    # ...and without staging on offer, DMA's pair wins against the copy kernel's
    kernel = measurement.Measurement(
        alone={"store": {"dma": 1.02, "kernel": 1.0}, "load": {"dma": 1.0, "kernel": 0.99}},
        both={("dma", "dma"): 1.025, ("kernel", "dma"): 1.01, ("kernel", "kernel"): 1.0},
        policy={"store": "kernel", "load": "kernel"},
    )
    assert kernel.choice() == dict.fromkeys(CHOICES, "dma")
    # outside the margin the faster wins, whatever it takes
    clear = dataclasses.replace(
        tied,
        alone={"store": {"dma": 1.05, "staged": 1.0}, "load": {"dma": 1.0, "kernel": 0.9}},
        both={("dma", "dma"): 0.9, ("staged", "dma"): 1.02, ("staged", "staged"): 1.0},
    )
    assert clear.choice() == {
        "store": "staged",
        "load": "kernel",
        "store_beside": "dma",
        "load_beside": "dma",
    }


class SlowToIssue:
    """A handler whose transfer_async takes `issue` seconds and whose jobs are done at once."""

    def __init__(self, issue: float) -> None:
        self.issue = issue
        self.done: list[TransferResult] = []

    def transfer_async(self, job_id: int, *specs: object) -> bool:
        time.sleep(self.issue)
        self.done.append(TransferResult(job_id, True, 1, 0.0))
        return True

    def wait(self, job_ids: object) -> None:
        pass

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done


def test_a_trial_is_judged_with_the_issuing_thread_at_half_its_speed() -> None:
    """A backend whose issuing only just keeps ahead of its copies is CPU-bound whenever the
    host's CPU slows (docs/transfer.md F25, F29): its trial counts SLOW_CPU times its
    submitting where that exceeds the wall time."""
    assert measurement.SLOW_CPU == 2.0
    assert measurement.judged_seconds(1.0, 0.3) == 1.0  # the copies bound it: as measured
    assert measurement.judged_seconds(1.0, 0.8) == 1.6
    handler = cast(Any, SlowToIssue(0.002))
    specs = cast(Any, [(None, None)] * 3)
    submitting = measurement._run(handler, None, specs, [], itertools.count())
    assert submitting is not None
    assert 3 * 0.002 * measurement.PASSES <= submitting < 10 * 3 * 0.002 * measurement.PASSES
    seconds = measurement._seconds(handler, None, specs, [], itertools.count(), torch.device("cpu"))
    assert seconds >= measurement.SLOW_CPU * 3 * 0.002 * measurement.PASSES


@pytest.mark.parametrize(
    ("pages", "gpu_to_cpu", "tried"),
    [
        ([2 * 1024 * 1024], True, ["dma", "staged"]),  # a block-outer cache's one page a block
        ([896 * 1024], False, ["dma", "staged"]),
        ([64 * 1024] * 32, True, ["dma", "staged"]),  # from the policy's 64 KiB: DMA's
        ([32 * 1024] * 64, True, ["dma", "kernel", "staged"]),  # under it: the kernel's
        ([8 * 1024] * 160, False, ["dma", "kernel", "staged"]),
    ],
)
def test_the_copy_kernel_is_tried_only_for_pages_the_policy_gives_it(
    pages: list[int], gpu_to_cpu: bool, tried: list[str]
) -> None:
    """It holds SMs for the whole transfer (docs/transfer.md F43): at large pages a trial
    judged at half the CPU's speed chose it over DMA, which moved more."""
    assert policy.worth_trying(["dma", "kernel", "staged"], pages, gpu_to_cpu) == tried
    every = ["dma", "kernel", "staged", "strided"]  # strided: under copy-engines only
    assert policy.worth_trying(every, pages, gpu_to_cpu) == tried
    assert policy.worth_trying(["kernel"], pages, gpu_to_cpu) == ["kernel"]  # all there is
    assert policy.worth_trying(["cpu"], pages, gpu_to_cpu) == ["cpu"]


def test_a_failed_job_is_never_chosen() -> None:
    measured = measurement.Measurement(
        alone={"store": {"dma": 1.0, "kernel": float("inf")}, "load": {"dma": 1.0}},
        both={("dma", "dma"): 2.0, ("kernel", "dma"): float("inf")},
        policy={"store": "kernel", "load": "dma"},
    )
    assert measured.choice() == dict.fromkeys(CHOICES, "dma")


def test_workload_moves_every_scratch_block_once_and_half_each_way() -> None:
    work = workload.Workload.of(scratch_blocks=100, num_chunks=1000, groups=2, blocks_per_chunk=2)
    every = [b for gpu, _ in work.every for b in gpu.block_ids]
    assert sorted(every) == list(range(len(every))) and len(every) == 96  # 3 pairs of 16-job
    assert all(len(gpu.block_ids) == 16 for gpu, _ in work.every)
    assert all(len(cpu.block_ids) == 8 for _, cpu in work.every)  # 2 blocks per chunk
    stored = {b for gpu, _ in work.stores for b in gpu.block_ids}
    loaded = {b for gpu, _ in work.loads for b in gpu.block_ids}
    assert len(stored) == len(loaded) == 48 and not stored & loaded
    assert all(list(gpu.group_sizes) == [16, 0] for gpu, _ in work.every)
    tiny = workload.Workload.of(scratch_blocks=2, num_chunks=1, groups=1, blocks_per_chunk=1)
    assert [len(g.block_ids) for g, _ in tiny.every] == [1]
