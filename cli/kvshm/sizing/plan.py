"""From a model's KV shape, vLLM's parallelism and a CPU budget to the region layout vLLM 0.33's
CPUOffloadingSpec computes: chunks of blocks_per_chunk blocks, one cell per worker per chunk (or
one shared cell for MLA's replicated layout), each row padded to a page."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvshm.region.errors import InvalidLayoutError
from kvshm.region.layout import MAX_REGION_BYTES, RegionFormat, RegionLayout
from kvshm.sizing.errors import SizingError, quoted, require_int
from kvshm.sizing.model import ModelKVShape, normalise_kv_cache_dtype

DEFAULT_BLOCK_SIZE = 16  # vLLM's --block-size default for CUDA attention backends
DEFAULT_BLOCKS_PER_CHUNK = 1  # vLLM's default when kv_connector_extra_config names none
FORMATS = ("vllm-0.33", "vllm-0.27")  # the region formats vLLM itself reads (see docs/vllm.md)


@dataclass(frozen=True)
class Parallelism:
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "data_parallel_size"):
            require_int(getattr(self, name), name)


@dataclass(frozen=True)
class RegionPlan:
    """One engine's region: what the OffloadRegion's layout says and what vLLM is told."""

    engine_id: str  # the id vLLM names the file after (with _dp<rank> under data parallelism)
    num_blocks: int  # vLLM's num_chunks
    cpu_page_size: int  # vLLM's cpu_page_size_per_worker
    num_workers: int  # tensor-parallel size
    replicated: bool  # MLA: one copy per row, every worker maps it
    row_stride: int  # vLLM's kv_bytes_per_chunk (padded)
    blocks_per_chunk: int

    @property
    def cpu_bytes_to_use(self) -> int:
        """What vLLM is given: exactly the region, so it computes the same num_chunks."""
        return self.num_blocks * self.row_stride


@dataclass(frozen=True)
class OffloadPlan:
    """The regions (one per data-parallel engine) and the numbers vLLM's flags carry."""

    engine_id: str  # the id given to vLLM (before vLLM appends _dp<rank>)
    parallelism: Parallelism
    block_size: int
    kv_cache_dtype: str
    worker_bytes_per_block: int
    regions: tuple[RegionPlan, ...]


def plan_offload(
    shape: ModelKVShape,
    engine_id: str,
    cpu_bytes: int,
    parallelism: Parallelism,
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    blocks_per_chunk: int = DEFAULT_BLOCKS_PER_CHUNK,
    kv_cache_dtype: str = "auto",
) -> OffloadPlan:
    """The layout vLLM 0.33 computes for this model, given cpu_bytes per engine."""
    require_int(block_size, "block_size")
    require_int(blocks_per_chunk, "blocks_per_chunk")
    require_int(cpu_bytes, "cpu_bytes")
    tp = parallelism.tensor_parallel_size
    worker_block = shape.worker_bytes_per_block(tp, block_size, kv_cache_dtype)
    # vLLM keeps one copy of MLA's latent when every TP worker holds the same bytes
    replicated = shape.mla and tp > 1
    copies = 1 if replicated else tp
    chunk = (
        f"one chunk ({blocks_per_chunk} block(s) of {block_size} tokens on {copies} worker cell(s))"
    )
    cpu_page_size = worker_block * blocks_per_chunk
    try:
        # the padded row of the region format vLLM 0.33 reads (one row is enough to ask)
        row_stride = RegionLayout(1, cpu_page_size, tp, replicated=replicated).row_stride
    except InvalidLayoutError:
        raise SizingError(
            f"{chunk} takes {cpu_page_size * copies} bytes, more than a region can hold "
            f"({MAX_REGION_BYTES} bytes): check the model's layer and head counts, or use fewer "
            f"blocks per chunk or a smaller block size"
        ) from None
    num_blocks = cpu_bytes // row_stride
    if num_blocks < 1:
        raise SizingError(f"{cpu_bytes} CPU bytes hold no chunk: {chunk} takes {row_stride} bytes")
    try:
        # what the OffloadRegion's layout becomes: the agent and the CRD refuse what this does
        RegionLayout(num_blocks, cpu_page_size, tp, replicated=replicated)
    except InvalidLayoutError:
        largest = MAX_REGION_BYTES // row_stride * row_stride
        raise SizingError(
            f"{quoted(cpu_bytes)} CPU bytes is more than one region can hold: the largest that "
            f"fits is {largest} bytes ({largest // 2**30} GiB, {largest // row_stride} chunks of "
            f"{row_stride} bytes): ask for at most that"
        ) from None
    ids = (
        [engine_id]
        if parallelism.data_parallel_size == 1
        else [f"{engine_id}_dp{rank}" for rank in range(parallelism.data_parallel_size)]
    )
    regions = tuple(
        RegionPlan(id_, num_blocks, cpu_page_size, tp, replicated, row_stride, blocks_per_chunk)
        for id_ in ids
    )
    return OffloadPlan(
        engine_id,
        parallelism,
        block_size,
        normalise_kv_cache_dtype(kv_cache_dtype),
        worker_block,
        regions,
    )


def with_whole_huge_pages(plan: OffloadPlan, region_format: str, huge_page: int) -> OffloadPlan:
    """The plan with each region's numBlocks rounded down to the largest count whose files
    (vLLM's split for region_format) are all whole huge pages, so a region on a huge-page
    tmpfs is mapped with huge pages end to end (RegionLayout.with_whole_huge_pages). vLLM is
    told the smaller cpu_bytes_to_use, so it computes the same rows."""
    regions = []
    for region in plan.regions:
        layout = RegionLayout(
            region.num_blocks,
            region.cpu_page_size,
            region.num_workers,
            RegionFormat(region_format),
            replicated=region.replicated,
        )
        aligned = layout.with_whole_huge_pages(huge_page)
        regions.append(replace(region, num_blocks=aligned.num_blocks))
    return replace(plan, regions=tuple(regions))
