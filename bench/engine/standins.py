"""Stand-ins for the few compiled vLLM ops that the engine benchmark's path calls, for a GPU
machine where vLLM's compiled extensions cannot load (they are built against another torch).

Bench code only: kvshm's product never imports this module. `install()` registers each
stand-in as a torch library op under vLLM's own name, only where vLLM's op is missing, and
returns what it did, which the benchmark prints and records.

What each replaces (facts of vLLM 0.33's path with enforce_eager, native IR ops, Triton
attention and dummy weights):
- `vllm._C_stable_libtorch`: vllm/platforms/cuda.py imports it unconditionally; an empty
  module (the ops it would register are the ones below, or ones this path never calls).
- `_C::get_cuda_view_from_cpu_tensor`: the V2 model runner's UVA buffers, a CUDA tensor over
  pinned host memory (unified addressing: the host address is the device address).
- `_C::cutlass_scaled_mm_supports_fp8`, `_C::cutlass_scaled_mm_supports_block_fp8`:
  capability queries; False, since no CUTLASS kernel is loaded here.
- `_C_cache_ops::swap_blocks_batch`: vLLM's CPU tier's DMA, one cuMemcpyBatchAsync per call
  over all its copies: loads with source access order ANY, stores STREAM, each copy with a
  host/device location hint (through kvshm's ctypes binding of the driver, the same call).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch

_libraries: list[Any] = []  # a torch Library unregisters its ops when collected


def _op_exists(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
        return True
    except (AttributeError, RuntimeError):
        return False


def _compiled_extension_loads() -> bool:
    try:
        import vllm._C  # noqa: F401
    except Exception:
        return False
    return True


class _CudaArray:
    """A bare __cuda_array_interface__ over `nbytes` bytes at `address`, keeping `owner` alive."""

    def __init__(self, address: int, nbytes: int, owner: torch.Tensor) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),
            "version": 3,
            "strides": None,
            "stream": None,
        }


def cuda_view_from_cpu_tensor(cpu_tensor: torch.Tensor) -> torch.Tensor:
    """A CUDA tensor aliasing a pinned CPU tensor's bytes (same shape, strides, dtype)."""
    if not cpu_tensor.is_pinned():
        raise ValueError("get_cuda_view_from_cpu_tensor stand-in: the tensor is not pinned")
    storage = cpu_tensor.untyped_storage()
    if storage.nbytes() == 0:
        return torch.empty(cpu_tensor.shape, dtype=cpu_tensor.dtype, device="cuda")
    raw = torch.as_tensor(
        _CudaArray(storage.data_ptr(), storage.nbytes(), cpu_tensor), device="cuda"
    )
    typed = raw.view(cpu_tensor.dtype)
    return typed.as_strided(cpu_tensor.size(), cpu_tensor.stride(), cpu_tensor.storage_offset())


def restated_swap_blocks_batch(location_hints: bool = True) -> Any:
    """vLLM's `swap_blocks_batch` re-stated through kvshm's ctypes binding of the driver: one
    cuMemcpyBatchAsync per call over all its copies, source order ANY for loads and STREAM for
    stores, each copy with host/device location hints as vLLM 0.33 gives them (without
    location_hints: no hints, as bench/vllm_plugin's baseline has always measured it)."""
    from kvshm.transfer.cuda.driver import (
        CU_MEM_LOCATION_TYPE_DEVICE,
        CU_MEM_LOCATION_TYPE_HOST,
        CU_MEMCPY_SRC_ACCESS_ORDER_ANY,
        CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
        CUmemcpyAttributes,
        CUmemLocation,
        cuda_driver,
    )

    driver = cuda_driver()

    def swap_blocks_batch(
        src_ptrs: torch.Tensor,
        dst_ptrs: torch.Tensor,
        sizes: torch.Tensor,
        is_src_access_order_any: bool = False,
    ) -> None:
        count = sizes.numel()
        if count == 0:
            return
        stream = torch.cuda.current_stream().cuda_stream
        if not driver.has_batch:  # below CUDA 12.8 vLLM loops over cudaMemcpyAsync
            for s, d, z in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist(), strict=True):
                driver.check("cuMemcpyAsync", driver.memcpy(d, s, z, stream))
            return
        # vLLM's worker asks for ANY only on loads (host to device), STREAM on stores
        if is_src_access_order_any:
            order = CU_MEMCPY_SRC_ACCESS_ORDER_ANY
        else:
            order = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        if location_hints:
            device = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, torch.cuda.current_device())
            host = CUmemLocation(CU_MEM_LOCATION_TYPE_HOST, 0)
            source, destination = (host, device) if is_src_access_order_any else (device, host)
        else:
            source = destination = CUmemLocation(0, 0)
        attributes = CUmemcpyAttributes(order, source, destination, 0)
        code = driver.memcpy_batch(
            dst_ptrs.data_ptr(), src_ptrs.data_ptr(), sizes.data_ptr(), count, attributes, stream
        )
        driver.check("cuMemcpyBatchAsync", code)

    return swap_blocks_batch


def _supports_nothing(cuda_device_capability: int) -> bool:
    return False


STANDINS: tuple[tuple[str, str, str, str, Any], ...] = (
    (
        "_C",
        "get_cuda_view_from_cpu_tensor",
        "get_cuda_view_from_cpu_tensor(Tensor cpu_tensor) -> Tensor",
        "CPU",
        lambda: cuda_view_from_cpu_tensor,
    ),
    (
        "_C",
        "cutlass_scaled_mm_supports_fp8",
        "cutlass_scaled_mm_supports_fp8(int cuda_device_capability) -> bool",
        "CompositeExplicitAutograd",
        lambda: _supports_nothing,
    ),
    (
        "_C",
        "cutlass_scaled_mm_supports_block_fp8",
        "cutlass_scaled_mm_supports_block_fp8(int cuda_device_capability) -> bool",
        "CompositeExplicitAutograd",
        lambda: _supports_nothing,
    ),
    (
        "_C_cache_ops",
        "swap_blocks_batch",
        "swap_blocks_batch(Tensor src_ptrs, Tensor dst_ptrs, Tensor sizes, "
        "bool is_src_access_order_any=False) -> ()",
        "CPU",
        restated_swap_blocks_batch,
    ),
)


def install(with_dma: bool = True) -> list[str]:
    """Register every stand-in whose vLLM op is missing; returns what was done, one line each.
    Call before anything imports vllm.platforms. with_dma=False leaves out the DMA op (for a
    machine without a CUDA driver: the registration itself is then what is checked)."""
    done: list[str] = []
    if not _compiled_extension_loads():
        import importlib

        try:
            spec = importlib.import_module("vllm._C_stable_libtorch").__spec__
            origin = spec.origin if spec is not None else None
        except ImportError:  # no startup hook in this process: this process only
            sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
            origin = "this process only"
        done.append(
            f"vllm._C_stable_libtorch: an empty module ({origin}; vllm/platforms/cuda.py "
            "imports it)"
        )
    libraries: dict[str, Any] = {}
    for namespace, name, schema, key, make in STANDINS:
        if not with_dma and name == "swap_blocks_batch":
            continue
        if _op_exists(namespace, name):
            done.append(f"{namespace}::{name}: vLLM's compiled op (kept)")
            continue
        library = libraries.get(namespace)
        if library is None:
            library = libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
            _libraries.append(library)
        library.define(schema)
        library.impl(name, make(), key)
        done.append(f"{namespace}::{name}: stand-in registered (torch library op, {key})")
    return done
