"""Round four: can the SMs' own path to host memory go faster than ~51 GB/s with other loads?

A CUDA C++ copy kernel (compiled with NVRTC, launched through the driver API) in variants:
plain 16-byte loads, loads with an L2 prefetch-size hint (.L2::64B/128B/256B), non-coherent
loads, and 1-D bulk copies (cp.async.bulk, the TMA unit) through shared memory. Same jobs as
bench_transfer (2 tensors per worker, random ids, 64 MiB jobs). The load variants share one
simple loop (slower than the Triton kernel), so compare them with each other; the bulk variant
is the one to compare with the Triton kernel.

    PYTHONPATH=agent:operator python3 bench/transfer/explore_sm_path.py
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
from bench_transfer import BURST_BYTES, KIB, gbps, make_setup, median_seconds, wall
from cuda.bindings import driver as cu
from cuda.bindings import nvrtc
from explore import batches

from kvshm.transfer.batch import CopyBatch

SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;

#define LOOP_HEAD                                                                  \
  for (long long w = blockIdx.x; w < (long long)count * chunks; w += gridDim.x) { \
    long long c = w / chunks;                                                      \
    long long start = (w % chunks) * (long long)CHUNK;                           \
    long long size = table[2 * count + c];                                         \
    if (start >= size) continue;                                                   \
    const char* src = (const char*)table[c] + start;                               \
    char* dst = (char*)table[count + c] + start;                                   \
    long long n = size - start < CHUNK ? size - start : CHUNK;

#define VARIANT(NAME, LOAD)                                                        \
extern "C" __global__ void NAME(const long long* table, int count, int chunks) {  \
  LOOP_HEAD                                                                        \
    for (long long off = threadIdx.x * 64; off < n; off += blockDim.x * 64) {      \
      uint4 v[4];                                                                  \
      _Pragma("unroll") for (int k = 0; k < 4; k++) {                              \
        const char* p = src + off + 16 * k;                                        \
        asm volatile(LOAD : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w) : "l"(p)); \
      }                                                                            \
      _Pragma("unroll") for (int k = 0; k < 4; k++) *(uint4*)(dst + off + 16 * k) = v[k]; \
    }                                                                              \
  }                                                                                \
}

VARIANT(plain, "ld.global.v4.u32 {%0,%1,%2,%3}, [%4];")
VARIANT(l2_64, "ld.global.L2::64B.v4.u32 {%0,%1,%2,%3}, [%4];")
VARIANT(l2_128, "ld.global.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];")
VARIANT(l2_256, "ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];")
VARIANT(nc_256, "ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];")

// one CHUNK per step through shared memory with the bulk-copy (TMA) unit: thread 0 issues a
// global->shared bulk load, waits on an mbarrier, then a shared->global bulk store
extern "C" __global__ void bulk(const long long* table, int count, int chunks) {
  __shared__ __align__(128) char buffer[CHUNK];
  __shared__ __align__(8) u64 bar;
  u32 bar_addr = (u32)__cvta_generic_to_shared(&bar);
  u32 buf_addr = (u32)__cvta_generic_to_shared(buffer);
  if (threadIdx.x == 0) asm volatile("mbarrier.init.shared.b64 [%0], 1;" :: "r"(bar_addr));
  __syncthreads();
  u32 phase = 0;
  LOOP_HEAD
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared.b64 _, [%0], %1;"
                   :: "r"(bar_addr), "r"((u32)n));
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                   " [%0], [%1], %2, [%3];"
                   :: "r"(buf_addr), "l"(src), "r"((u32)n), "r"(bar_addr) : "memory");
      asm volatile("{ .reg .pred p; W: mbarrier.try_wait.parity.shared.b64 p, [%0], %1;"
                   " @!p bra W; }" :: "r"(bar_addr), "r"(phase) : "memory");
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;"
                   :: "l"(dst), "r"(buf_addr), "r"((u32)n) : "memory");
      asm volatile("cp.async.bulk.commit_group;");
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      phase ^= 1;
    }
  }
  if (threadIdx.x == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}
"""

VARIANTS = ["plain", "l2_64", "l2_128", "l2_256", "nc_256", "bulk"]


def check(result: object) -> object:
    code = result[0] if isinstance(result, tuple) else result
    if int(code) != 0:
        raise RuntimeError(f"CUDA call failed: {result}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


def compile_module(chunk: int) -> object:
    major, minor = torch.cuda.get_device_capability()
    source = SOURCE.replace("CHUNK", str(chunk)).encode()
    program = check(nvrtc.nvrtcCreateProgram(source, b"copy.cu", 0, [], []))
    options = [f"--gpu-architecture=sm_{major}{minor}a".encode(), b"-std=c++17"]
    code = nvrtc.nvrtcCompileProgram(program, len(options), options)
    if int(code[0]) != 0:
        size = check(nvrtc.nvrtcGetProgramLogSize(program))
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(program, log)
        raise RuntimeError(log.decode())
    size = check(nvrtc.nvrtcGetCUBINSize(program))
    cubin = b" " * size
    check(nvrtc.nvrtcGetCUBIN(program, cubin))
    return check(cu.cuModuleLoadData(cubin))


def launch(
    function: object, t: CopyBatch, chunks: int, grid: int, threads: int, stream: int
) -> None:
    values = [
        ctypes.c_longlong(t.table.data_ptr()),
        ctypes.c_int(t.count),
        ctypes.c_int(chunks),
    ]
    pointers = (ctypes.c_void_p * 3)(*[ctypes.addressof(v) for v in values])
    check(
        cu.cuLaunchKernel(
            function, grid, 1, 1, threads, 1, 1, 0, stream, ctypes.addressof(pointers), 0
        )
    )


def main() -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    print(f"device: {torch.cuda.get_device_name()}", flush=True)
    rng = np.random.default_rng(1)
    for block in (16 * KIB, 64 * KIB):
        setup = make_setup(block, "/dev/shm", rng, pass_bytes=BURST_BYTES)
        try:
            for chunk in (16 * KIB,):
                module = compile_module(chunk)
                for name in VARIANTS:
                    function = check(cu.cuModuleGetFunction(module, name.encode()))
                    for direction in ("H2D", "D2H"):
                        jobs = []
                        for b in batches(setup, direction):
                            t = CopyBatch.allocate(b.count, pinned=True)
                            t.rows[:] = b.rows
                            jobs.append(t)
                        stream = torch.cuda.Stream()
                        threads = 32 if name == "bulk" else 256
                        for grid in (32, 132, 264):

                            def issue(
                                function: object = function,
                                jobs: list[CopyBatch] = jobs,
                                grid: int = grid,
                                threads: int = threads,
                                stream: torch.cuda.Stream = stream,
                                chunks: int = max(1, block // chunk),
                            ) -> None:
                                for t in jobs:
                                    launch(function, t, chunks, grid, threads, stream.cuda_stream)

                            try:
                                r = gbps(setup.pass_bytes, median_seconds(lambda: wall(issue), 5))
                                print(
                                    f"{block // KIB}K {direction} {name} grid={grid}: {r:.1f} GB/s",
                                    flush=True,
                                )
                            except Exception as exc:
                                print(f"{block // KIB}K {direction} {name}: {exc}", flush=True)
                                break
        finally:
            setup.close()


if __name__ == "__main__":
    main()
