"""Thin typed calls into the CUDA driver (libcuda) for the copy hot path, by ctypes.

Why not cuda-bindings here: its cuMemcpyBatchAsync takes Python lists of CUdeviceptr objects,
one object per address, so issuing 16 KiB blocks costs more CPU time per block than the link
needs to move them (bench/transfer measures both). ctypes hands the driver the addresses of
the numpy descriptor rows directly, whatever their length. The library is loaded on first use,
so importing kvshm.transfer never needs a GPU.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from kvshm.transfer.errors import BackendUnavailableError, CudaCallError

CUDA_SUCCESS = 0
CUDA_ERROR_INVALID_VALUE = 1
CUDA_ERROR_NOT_SUPPORTED = 801

CU_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1
CU_MEMCPY_SRC_ACCESS_ORDER_ANY = 3
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_LOCATION_TYPE_HOST = 2
CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3
CU_STREAM_NON_BLOCKING = 1

BATCH_MIN_DRIVER = 12080  # cuMemcpyBatchAsync appeared in CUDA 12.8
BATCH_WITHOUT_FAIL_IDX = 13000  # CUDA 13 dropped its failIdx argument


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", CUmemLocation),
        ("dstLocHint", CUmemLocation),
        ("flags", ctypes.c_uint),
    ]


CU_MEMORYTYPE_UNIFIED = 4  # an address the driver resolves itself (unified addressing)


class CUDA_MEMCPY2D(ctypes.Structure):
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]

    @classmethod
    def rows(cls, width: int, height: int) -> CUDA_MEMCPY2D:
        """`height` rows of `width` bytes between unified addresses (set the four address
        and pitch fields per copy)."""
        params = cls()
        params.srcMemoryType = params.dstMemoryType = CU_MEMORYTYPE_UNIFIED
        params.WidthInBytes, params.Height = width, height
        return params


@dataclass(frozen=True)
class CopyDirection:
    """Where a batch's sources and destinations live, for the driver's attribute hints."""

    gpu_to_cpu: bool
    device_index: int

    def attributes(self) -> CUmemcpyAttributes:
        device = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.device_index)
        host = CUmemLocation(CU_MEM_LOCATION_TYPE_HOST, 0)
        # GPU->CPU reads the live KV cache, so its reads must wait in stream order behind the
        # compute the stream waited for. CPU->GPU reads region blocks no GPU stream writes
        # (the connector loads only blocks whose store finished), so the driver may read early.
        order = CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
        if not self.gpu_to_cpu:
            order = CU_MEMCPY_SRC_ACCESS_ORDER_ANY
        src, dst = (device, host) if self.gpu_to_cpu else (host, device)
        return CUmemcpyAttributes(order, src, dst, CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE)


class CudaDriver:
    """The few driver entry points the DMA backend calls, with their return codes."""

    def __init__(self, library: str = "libcuda.so.1") -> None:
        try:
            self._lib = ctypes.CDLL(library)
        except OSError as exc:
            raise BackendUnavailableError(f"cannot load the CUDA driver {library}: {exc}") from exc
        version = ctypes.c_int()
        self._lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
        if self._lib.cuDriverGetVersion(ctypes.byref(version)) != CUDA_SUCCESS:
            raise BackendUnavailableError("cuDriverGetVersion failed: is a GPU driver installed?")
        self.version = version.value
        self._memcpy_async = self._lib.cuMemcpyAsync
        self._memcpy_async.argtypes = [
            ctypes.c_uint64,
            ctypes.c_uint64,
            ctypes.c_size_t,
            ctypes.c_void_p,
        ]
        self._memcpy_async.restype = ctypes.c_int
        self._pointer_attribute = self._lib.cuPointerGetAttribute
        self._pointer_attribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
        self._pointer_attribute.restype = ctypes.c_int
        self._stream_create = self._lib.cuStreamCreate
        self._stream_create.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        self._stream_create.restype = ctypes.c_int
        self._memcpy_2d = getattr(self._lib, "cuMemcpy2DAsync_v2", None)
        if self._memcpy_2d is not None:
            self._memcpy_2d.argtypes = [ctypes.POINTER(CUDA_MEMCPY2D), ctypes.c_void_p]
            self._memcpy_2d.restype = ctypes.c_int
        self._current_context = self._lib.cuCtxGetCurrent
        self._current_context.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        self._current_context.restype = ctypes.c_int
        self._batch, self._batch_takes_fail_idx = self._find_batch()
        self._attrs_index = ctypes.c_size_t(0)  # read by the driver only
        # written by the driver on a failed call and never read (the CUresult says what went
        # wrong): threads issuing at once may share it
        self._fail_index = ctypes.c_size_t(0)

    def _find_batch(self) -> tuple[Any, bool]:
        if self.version < BATCH_MIN_DRIVER or not hasattr(self._lib, "cuGetProcAddress_v2"):
            return None, False
        takes_fail_idx = self.version < BATCH_WITHOUT_FAIL_IDX
        requested = BATCH_MIN_DRIVER if takes_fail_idx else BATCH_WITHOUT_FAIL_IDX
        get = self._lib.cuGetProcAddress_v2
        get.argtypes = [
            ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_int),
        ]
        function = ctypes.c_void_p()
        status = ctypes.c_int()
        code = get(
            b"cuMemcpyBatchAsync", ctypes.byref(function), requested, 0, ctypes.byref(status)
        )
        if code != CUDA_SUCCESS or not function.value:
            return None, False
        arguments = [ctypes.c_void_p] * 3 + [ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p]
        arguments += [ctypes.c_size_t] + [ctypes.c_void_p] * (2 if takes_fail_idx else 1)
        prototype = ctypes.CFUNCTYPE(ctypes.c_int, *arguments)  # CFUNCTYPE releases the GIL
        return prototype(function.value), takes_fail_idx

    @property
    def has_batch(self) -> bool:
        return self._batch is not None

    def memcpy_batch(
        self,
        dsts: int,
        srcs: int,
        sizes: int,
        count: int,
        attributes: CUmemcpyAttributes,
        stream: int,
    ) -> int:
        """cuMemcpyBatchAsync over `count` descriptors whose arrays start at the given
        addresses (uint64 each), with one attribute set for all; returns the CUresult."""
        if self._batch is None:
            return CUDA_ERROR_NOT_SUPPORTED
        attrs = ctypes.byref(attributes)
        index = ctypes.byref(self._attrs_index)
        if self._batch_takes_fail_idx:
            fail = ctypes.byref(self._fail_index)
            return int(self._batch(dsts, srcs, sizes, count, attrs, index, 1, fail, stream))
        return int(self._batch(dsts, srcs, sizes, count, attrs, index, 1, stream))

    def memcpy(self, dst: int, src: int, size: int, stream: int) -> int:
        """cuMemcpyAsync (unified addressing picks the direction); returns the CUresult."""
        return int(self._memcpy_async(dst, src, size, stream))

    def memcpy_2d(self, params: CUDA_MEMCPY2D, stream: int) -> int:
        """cuMemcpy2DAsync: Height rows of WidthInBytes from srcDevice (rows srcPitch apart) to
        dstDevice (dstPitch apart); returns the CUresult."""
        if self._memcpy_2d is None:
            return CUDA_ERROR_NOT_SUPPORTED
        return int(self._memcpy_2d(ctypes.byref(params), stream))

    def create_stream(self) -> int:
        """A new non-blocking stream in the calling thread's current context (make the device
        current first); raises CudaCallError."""
        handle = ctypes.c_void_p()
        self.check(
            "cuStreamCreate", self._stream_create(ctypes.byref(handle), CU_STREAM_NON_BLOCKING)
        )
        assert handle.value is not None
        return handle.value

    def has_current_context(self) -> bool:
        """Whether the calling thread has a CUDA context current (a thread the process
        started has none until something, torch.cuda.set_device say, makes one current)."""
        context = ctypes.c_void_p()
        return self._current_context(ctypes.byref(context)) == CUDA_SUCCESS and bool(context.value)

    def device_pointer(self, host_address: int) -> int | None:
        """The device address of registered host memory, or None if it is not registered."""
        value = ctypes.c_uint64()
        code = self._pointer_attribute(
            ctypes.byref(value), CU_POINTER_ATTRIBUTE_DEVICE_POINTER, host_address
        )
        return value.value if code == CUDA_SUCCESS else None

    def check(self, call: str, code: int) -> None:
        if code != CUDA_SUCCESS:
            raise CudaCallError(call, code)


_driver: CudaDriver | None = None


def cuda_driver() -> CudaDriver:
    """The process's one CudaDriver, loaded on first use."""
    global _driver
    if _driver is None:
        _driver = CudaDriver()
    return _driver
