"""A model-less vLLM 0.33 engine on CPU: vLLM's own Scheduler (its KV cache manager, its
block hashing, the OffloadingConnector's scheduler side with the plugin's manager) and the
connector's worker side with the plugin's worker on CPU tensors, stepped as EngineCore and the
model runner step them (KVConnectorModelRunnerMixin's connector calls), with a fake model
that writes every block it computes as a pattern of the block's hash.

So a block's bytes say which prefix they belong to: a block found computed (from the GPU
prefix cache or loaded from the CPU tier) that does not hold its own hash's pattern is a
wrong load, and is counted.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from typing import Any

import torch

from tests.vllm_plugin.engine import TINY_LAYERS, TINY_PAGE

TOKENS_PER_BLOCK = 16


def block_pattern(block_hash: bytes) -> torch.Tensor:
    """The bytes the fake model writes in every layer's page of a block."""
    digest = hashlib.sha256(bytes(block_hash)).digest()
    return torch.frombuffer(bytearray(digest * (TINY_PAGE // len(digest))), dtype=torch.int8)


class ModelLessEngine:
    def __init__(self, config: Any, kv_cache_config: Any) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        self.started = time.perf_counter()
        num_blocks = kv_cache_config.num_blocks
        config.cache_config.num_gpu_blocks = num_blocks
        self.scheduler = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=TOKENS_PER_BLOCK,
            hash_block_size=TOKENS_PER_BLOCK,
            log_stats=True,
        )
        # as EngineCore does, after it has built the scheduler
        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(TOKENS_PER_BLOCK, hash_fn)
        self.worker = OffloadingConnector(config, KVConnectorRole.WORKER, kv_cache_config)
        self.backing = torch.zeros((TINY_LAYERS, num_blocks, TINY_PAGE), dtype=torch.int8)
        (group,) = kv_cache_config.kv_cache_groups
        self.worker.register_kv_caches(
            {name: self.backing[i] for i, name in enumerate(group.layer_names)}
        )
        self.wrong_blocks = 0
        """Blocks found computed that did not hold their own hash's pattern."""
        self.checked_blocks = 0
        self.loaded_keys: list[bytes] = []
        self.first_hit_seconds: float | None = None
        manager = self.manager
        prepare_load = manager.prepare_load

        def counting_prepare_load(keys: Any, req_context: Any) -> Any:
            if self.first_hit_seconds is None:
                self.first_hit_seconds = time.perf_counter() - self.started
            self.loaded_keys.extend(keys)
            return prepare_load(keys, req_context)

        manager.prepare_load = counting_prepare_load

    @property
    def manager(self) -> Any:
        return self.scheduler.connector.connector_scheduler.manager

    def add(self, request_id: str, tokens: Sequence[int]) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        request = Request(
            request_id, list(tokens), SamplingParams(max_tokens=1), None, block_hasher=self.hasher
        )
        self.scheduler.add_request(request)
        return request

    def step(self) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        sampled = []
        for request_id, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            end = request.num_computed_tokens
            start = end - count
            (block_ids,) = self.scheduler.kv_cache_manager.get_block_ids(request_id)
            for block in range(start // TOKENS_PER_BLOCK):  # computed before: cache or CPU
                self.checked_blocks += 1
                page = block_pattern(request.block_hashes[block])
                if not all(
                    torch.equal(self.backing[layer, block_ids[block]], page)
                    for layer in range(TINY_LAYERS)
                ):
                    self.wrong_blocks += 1
            for block in range(start // TOKENS_PER_BLOCK, end // TOKENS_PER_BLOCK):
                if block < len(request.block_hashes):  # the model computes these blocks
                    self.backing[:, block_ids[block]] = block_pattern(request.block_hashes[block])
            sampled.append([7] if end >= request.num_prompt_tokens else [])
        worker = self.worker
        worker.bind_connector_metadata(out.kv_connector_metadata)
        worker.start_load_kv(None)
        worker.wait_for_save()
        results = worker.get_transfer_results(out.finished_req_ids)
        meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        request_ids = list(out.num_scheduled_tokens)
        self.scheduler.update_from_output(
            out,
            ModelRunnerOutput(
                req_ids=request_ids,
                req_id_to_index={r: i for i, r in enumerate(request_ids)},
                sampled_token_ids=sampled,
                kv_connector_output=KVConnectorOutput(
                    finished_sending=results.finished_sending,
                    finished_recving=results.finished_recving,
                    kv_connector_worker_meta=meta,
                ),
            ),
        )
        return out

    def run(self, timeout_s: float = 120.0) -> None:
        """Step until every request finished and every transfer was reported. Bounded by time,
        not steps: the worker's copies run in threads, and on a busy machine a step that waits
        for one schedules nothing and takes microseconds (it then yields the core a moment)."""
        idle = 0
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            out = self.step()
            if self.scheduler.has_requests():
                idle = 0
                if not out.num_scheduled_tokens:
                    time.sleep(0.0005)  # waiting for a transfer: let its thread run
            else:
                idle += 1
                if idle >= 3:  # stores are submitted a step late and reported a step later
                    return
        raise AssertionError(f"the engine did not go idle in {timeout_s:.0f} s")

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
