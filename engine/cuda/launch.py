"""Launchers: one Python function per kernel family, shapes checked, launch rules as written beside each kernel."""
from __future__ import annotations

import numpy as np

from .build import kernel
from .weights import GPUWeight

MMQ_BM, MMQ_BN = 128, 64
# kernels/mmq.cu MMQ_SMEM_BYTES: raw weights x2, unpacked weights, activations x2, weight scales and terms, act. scales x2
MMQ_SMEM_BYTES = 2 * 128 * 320 + 128 * 272 + 2 * 64 * 272 + 2 * 128 * 8 * 2 * 4 + 2 * 64 * 8 * 2 * 8
MMVQ_THREADS = 128


def mmvq_rows(ncols: int) -> int:
    """Rows each MMVQ thread group serves (kernels/mmvq.cu mmvq_rows)."""
    return 1 if ncols == 1 else 2


def _cp():
    import cupy
    return cupy


def quantize_q8_1(x, n_pad: int | None = None):
    """x: [n, k] f32 -> (qs [n_pad, k] int8, ds [n_pad, k/16] float2 as f32 [n_pad, k/8])."""
    cp = _cp()
    n, k = x.shape
    if k % 32:
        raise ValueError(f"quantize_q8_1: k={k} is not a multiple of 32")
    n_pad = n_pad or n
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    qs = cp.empty((n_pad, k), cp.int8)
    ds = cp.empty((n_pad, k // 8), cp.float32)
    warps = n_pad * (k // 32)
    kernel("quantize", "quantize_q8_1")(((warps + 7) // 8,), (32, 8),
                                        (x, qs, ds, np.int32(n), np.int32(n_pad), np.int32(k)))
    return qs, ds


def mmvq(w: GPUWeight, qs, ds, n: int, out=None):
    """y [n, m] = x W^T for n <= 8 columns (activations from quantize_q8_1)."""
    cp = _cp()
    y = out if out is not None else cp.empty((n, w.m), cp.float32)
    chunks = w.k // 32
    groups = 1 if chunks >= 128 else 2 if chunks >= 64 else 4     # 128, 64 or 32 threads per group of rows
    rows_per_block = groups * mmvq_rows(n)
    grid = ((w.m + rows_per_block - 1) // rows_per_block,)
    kernel("mmvq", f"mmvq<{int(w.type)}, {n}>")(grid, (MMVQ_THREADS,),
                                                 (w.data, qs, ds, y, np.int32(w.m), np.int32(w.k),
                                                  np.int64(w.row_bytes), np.int32(groups)))
    return y


def mmq(w: GPUWeight, qs, ds, n: int, out=None):
    """y [n, m] = x W^T on int8 tensor cores; qs/ds padded to a multiple of MMQ_BN columns."""
    cp = _cp()
    n_pad = qs.shape[0]
    assert n_pad % MMQ_BN == 0 and n <= n_pad
    y = out if out is not None else cp.empty((n, w.m), cp.float32)
    k = kernel("mmq", f"mmq<{int(w.type)}>")
    if k.max_dynamic_shared_size_bytes < MMQ_SMEM_BYTES:
        k.max_dynamic_shared_size_bytes = MMQ_SMEM_BYTES
    grid = ((w.m + MMQ_BM - 1) // MMQ_BM, n_pad // MMQ_BN)
    k(grid, (256,), (w.data, qs, ds, y, np.int32(w.m), np.int32(n), np.int32(w.k), np.int64(w.row_bytes)),
      shared_mem=MMQ_SMEM_BYTES)
    return y


def dequantize(w: GPUWeight, dtype="f16", rows=None):
    """Quantized W -> [m, k] f16/f32, or only the given rows (an embedding lookup) -> [len(rows), k]."""
    cp = _cp()
    n_rows = w.m if rows is None else len(rows)
    out = cp.empty((n_rows, w.k), cp.float16 if dtype == "f16" else cp.float32)
    return dequantize_into(w, out, rows)


def dequantize_into(w: GPUWeight, out, rows=None):
    """dequantize() into a preallocated [n_rows, k] f16/f32 buffer."""
    cp = _cp()
    idx = None if rows is None else cp.ascontiguousarray(rows, dtype=cp.int32)
    n_rows = out.shape[0]
    dtype = "f16" if out.dtype == cp.float16 else "f32"
    chunks = n_rows * (w.k // 32)
    kernel("dequantize", f"dequantize_{dtype}<{int(w.type)}>")(
        ((chunks + 255) // 256,), (256,),
        (w.data, idx if idx is not None else np.uint64(0), out, np.int32(n_rows), np.int32(w.k),
         np.int64(w.row_bytes)))
    return out


def mmvf(w: GPUWeight, x, out=None):
    """y [n, m] = x W^T for f16/f32 weights and n <= 8."""
    cp = _cp()
    n = x.shape[0]
    y = out if out is not None else cp.empty((n, w.m), cp.float32)
    wt = "u16" if w.data.dtype == cp.float16 else "float"
    kernel("mmvf", f"mmvf<{wt}, {n}>")(((w.m + 3) // 4,), (32, 4),
                                        (w.data, cp.ascontiguousarray(x, dtype=cp.float32), y,
                                         np.int32(w.m), np.int32(w.k)))
    return y


def gemm_xwt(x, w, out=None):
    """cuBLAS: y [n, m] f32 = x [n, k] @ w [m, k]^T for f16 or f32 operands, fp32 accumulation and output."""
    cp = _cp()
    from cupy.cuda import cublas

    n, k = x.shape
    m = w.shape[0]
    dt = w.dtype
    x = cp.ascontiguousarray(x, dtype=dt)
    y = out if out is not None else cp.empty((n, m), cp.float32)
    ctype = {cp.dtype(cp.float16): 2, cp.dtype(cp.float32): 0}[cp.dtype(dt)]   # CUDA_R_16F, CUDA_R_32F
    one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
    cublas.gemmEx(cp.cuda.device.get_cublas_handle(), cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, n, k,
                  one.ctypes.data, w.data.ptr, ctype, k, x.data.ptr, ctype, k,
                  zero.ctypes.data, y.data.ptr, 0, m, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    return y
