"""cublasGemmEx through ctypes, for use while a stream is being captured into a CUDA graph.

CuPy's cuBLAS wrappers set the handle's stream on every call and refuse to while the stream captures (cuBLAS itself
supports capture). This module calls the same libcublas that CuPy loaded, on CuPy's handle, whose stream the eager run
before the capture already set to the capturing stream.
"""
from __future__ import annotations

import ctypes
import functools

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1


@functools.cache
def _library():
    """The libcublas CuPy has loaded (the handle belongs to it), found in this process's memory map; None if absent."""
    from cupy.cuda import device
    device.get_cublas_handle()                          # makes CuPy load libcublas
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcublas.so" in line and "libcublasLt" not in line}
    except OSError:
        return None
    if not paths:
        return None
    lib = ctypes.CDLL(sorted(paths)[0])
    fn = lib.cublasGemmEx
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                   ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int]
    return fn


def gemm_ex(handle: int, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int, a_type: int, lda: int,
            b: int, b_type: int, ldb: int, beta: int, c: int, c_type: int, ldc: int) -> None:
    """cublasGemmEx with fp32 compute and the default algorithm, on the stream the handle already has."""
    fn = _library()
    if fn is None:
        raise RuntimeError("libcublas is not in this process's memory map: no GEMM during a CUDA graph capture")
    status = fn(handle, transa, transb, m, n, k, alpha, a, a_type, lda, b, b_type, ldb, beta, c, c_type, ldc,
                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT)
    if status != 0:
        raise RuntimeError(f"cublasGemmEx failed during a CUDA graph capture (status {status})")
