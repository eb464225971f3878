"""Launchers of the small kernel families (quantize, dequantize, mmvf, cuBLAS, attention) and the helpers every
launch module shares; MMVQ's and MMQ's launch rules are in mmvq.py and mmq.py, beside their kernels' names."""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from .build import DECODE_GROUPS, DECODE_HEAD_DIMS, DECODE_MMA_HEAD_DIMS, constants, kernel
from .weights import GPUWeight

_MMVF = constants("mmvf")                 # the kernels' own #defines


def _cp():
    import cupy
    return cupy


def quantize_q8_1(x, n_pad: int | None = None, out: tuple | None = None, residual: bool = False):
    """x: [n, k] f32 -> (qs [n_pad, k] int8, ds [n_pad, k/16] float2 as f32 [n_pad, k/8]); with residual, (qs, ds,
    rs [n_pad, k] int8): the residual plane too, and ds's sums those of q + rs / Q8_RESIDUAL (kernels/common.cuh
    warp_store_q8_1). Into out = (qs, ds) or (qs, ds, rs) when given (a benchmark's graph re-quantizing into the
    same buffers), which then decides whether the residual plane is written."""
    cp = _cp()
    n, k = x.shape
    if k % 32:
        raise ValueError(f"quantize_q8_1: k={k} is not a multiple of 32")
    n_pad = n_pad or n
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    planes = out or (cp.empty((n_pad, k), cp.int8), cp.empty((n_pad, k // 8), cp.float32)) + (
        (cp.empty((n_pad, k), cp.int8),) if residual else ())
    rs = planes[2] if len(planes) > 2 else np.uint64(0)
    warps = n_pad * (k // 32)
    kernel("quantize", "quantize_q8_1")(((warps + 7) // 8,), (32, 8),
                                        (x, planes[0], planes[1], rs, np.int32(n), np.int32(n_pad), np.int32(k)))
    return planes


@functools.cache
def _sm_count() -> int:
    return _cp().cuda.Device().attributes["MultiProcessorCount"]


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
    threads = constants("dequantize")["DEQUANT_THREADS"]
    kernel("dequantize", f"dequantize_{dtype}<{int(w.type)}>")(
        ((chunks + threads - 1) // threads,), (threads,),
        (w.data, idx if idx is not None else np.uint64(0), out, np.int32(n_rows), np.int32(w.k),
         np.int64(w.row_bytes)))
    return out


MMVF_THREADS = _MMVF["MMVF_THREADS"]
MMVF_MAX_COLS = 8                       # columns one mmvf launch takes (its instantiations)


def should_use_mmvf(w: GPUWeight, n: int) -> bool:
    """Float weights at up to MMVF_MAX_COLS columns (above: cuBLAS)."""
    return not w.quantized and n <= MMVF_MAX_COLS


def mmvf_rows(ncols: int) -> int:
    """Rows each MMVF block serves (kernels/mmvf.cu mmvf_rows)."""
    return _MMVF["MMVF_ROWS_1"] if ncols == 1 else _MMVF["MMVF_ROWS_N"] if ncols <= 3 else _MMVF["MMVF_ROWS_HI"]


def mmvf(w, x, out=None):
    """y [n, m] = x W^T for f16/f32 weights w ([m, k]), in launches of up to MMVF_MAX_COLS columns (each reads W)."""
    cp = _cp()
    n = x.shape[0]
    m, k = w.shape
    x = cp.ascontiguousarray(x, dtype=cp.float32)
    y = out if out is not None else cp.empty((n, m), cp.float32)
    wt, vec = ("u16", 8) if w.dtype == cp.float16 else ("float", 4)
    if k % vec or w.data.ptr % 16 or x.data.ptr % 16:             # rows not 16-byte aligned: plain loads
        vec = 1
    for j in range(0, n, MMVF_MAX_COLS):
        nj = min(MMVF_MAX_COLS, n - j)
        rows = mmvf_rows(nj)
        kernel("mmvf", f"mmvf<{wt}, {nj}, {vec}>")(((m + rows - 1) // rows,), (MMVF_THREADS,),
                                                    (w, x[j:j + nj], y[j:j + nj], np.int32(m), np.int32(k)))
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
    handle = cp.cuda.device.get_cublas_handle()
    stream = cp.cuda.get_current_stream()
    if stream.is_capturing():                 # CuPy's wrappers refuse; the handle is already on this stream
        from .cublas_capture import CUBLAS_OP_N, CUBLAS_OP_T, gemm_ex
        gemm_ex(handle, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, one.ctypes.data, w.data.ptr, ctype, k, x.data.ptr, ctype,
                k, zero.ctypes.data, y.data.ptr, 0, m)
        return y
    cublas.setStream(handle, stream.ptr)
    cublas.gemmEx(handle, cublas.CUBLAS_OP_T, cublas.CUBLAS_OP_N, m, n, k,
                  one.ctypes.data, w.data.ptr, ctype, k, x.data.ptr, ctype, k,
                  zero.ctypes.data, y.data.ptr, 0, m, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT)
    return y


def resident_blocks(fn, threads: int, smem: int) -> int:
    """Blocks of kernel fn (threads each, smem bytes of dynamic shared memory) one multiprocessor holds at once: the
    least of its thread, register (allocated per warp in 256s) and shared-memory limits (each block also takes the
    driver's reserved shared memory)."""
    a = _cp().cuda.Device().attributes
    warps = -(-threads // 32)
    regs_per_warp = -(-fn.num_regs * 32 // 256) * 256
    by_regs = a["MaxRegistersPerMultiprocessor"] // regs_per_warp // warps
    by_smem = a["MaxSharedMemoryPerMultiprocessor"] // (fn.shared_size_bytes + smem +
                                                        a.get("ReservedSharedMemoryPerBlock", 0))
    return max(1, min(by_regs, by_smem, a["MaxThreadsPerMultiProcessor"] // threads,
                      a.get("MaxBlocksPerMultiprocessor", 32)))


def with_smem(fn, smem: int):
    """Allow fn smem bytes of dynamic shared memory (above the 48 KB default); returns fn."""
    if fn.max_dynamic_shared_size_bytes < smem:
        fn.max_dynamic_shared_size_bytes = smem
    return fn


def prefill_rows(mma: bool) -> int:
    """Query rows a prefill attention block takes: attention_prefill_mma's FA_BQ (f16 cache), attention_prefill's
    PREFILL_BQ (f32 cache)."""
    return constants("attention_mma")["FA_BQ"] if mma else constants("attention")["PREFILL_BQ"]


def prefill_tiles(runs, rows: int) -> np.ndarray:
    """The blocks of one prefill attention launch over several sequences' chunks -> [n_tiles, 2] int32, each block's
    first query row and its row count: every run (a, b) (rows a..b-1, one sequence's queries at consecutive
    positions) cut into tiles of at most `rows`, so that no block mixes two sequences."""
    tiles = [(t, min(rows, b - t)) for a, b in runs for t in range(a, b, rows)]
    return np.array(tiles, np.int32).reshape(-1, 2)


def attention_prefill_mma(d: int, grid: tuple, args: tuple) -> None:
    """kernels/attention_mma.cu attention_prefill_mma<d>: block 128, attention_mma_smem_bytes(d) of shared memory."""
    c = constants("attention_mma")
    smem = (c["FA_BQ"] + 2 * c["FA_BK"]) * (d + 8) * 2     # queries + K tile + V tile, f16 rows padded by 8
    with_smem(kernel("attention_mma", f"attention_prefill_mma<{d}>"), smem)(grid, (128,), args, shared_mem=smem)


def attention_prefill_simt(kv_type: str, d: int, grid: tuple, args: tuple) -> None:
    """kernels/attention.cu attention_prefill<kv_type, d> (an f32 or q8_0 cache): block 128, prefill_smem_floats(d)
    floats."""
    c = constants("attention")
    bq, bk = c["PREFILL_BQ"], c["PREFILL_BK"]
    smem = ((bq + bk) * (d + 1) + bk * d + bq * (bk + 1)) * 4     # prefill_smem_floats(d)
    with_smem(kernel("attention", f"attention_prefill<{kv_type}, {d}>"), smem)(grid, (128,), args, shared_mem=smem)


class DecodeKernel(NamedTuple):
    """The attention.cu kernel a decode attention launch takes (launch rules in kernels/attention.cu)."""
    name: str        # the instantiation
    rows: int        # query heads one block takes (a GQA group of more takes several blocks)
    smem: int        # dynamic shared memory, bytes


def decode_kernel(kv_type: str, head_dim: int, group: int, softcap: float) -> DecodeKernel:
    """Decode attention for a GQA group of `group` query heads: attention_decode_mma (f16 tensor cores, up to
    DECODE_MMA_ROWS query heads a block) for an f16 cache of a head size it takes, else attention_decode (DP the
    smallest of DECODE_HEAD_DIMS holding head_dim, GMAX decode_group_max)."""
    cap = "true" if softcap else "false"
    if kv_type == "u16" and head_dim in DECODE_MMA_HEAD_DIMS:
        c = constants("attention")
        return DecodeKernel(f"attention_decode_mma<{head_dim}, {cap}>", c["DECODE_MMA_ROWS"],
                            c["DECODE_MMA_SMEM_ROWS"] * (head_dim + 8) * 2)     # decode_mma_smem_bytes
    dp = next(h for h in DECODE_HEAD_DIMS if h >= head_dim)
    gmax = decode_group_max(group)
    return DecodeKernel(f"attention_decode<{kv_type}, {dp}, {gmax}, {cap}>", gmax, 0)


def decode_group_max(group: int) -> int:
    """The query heads one attention_decode block takes: the smallest of DECODE_GROUPS holding the group, else the
    largest (a group then takes several blocks)."""
    return next((g for g in DECODE_GROUPS if g >= group), DECODE_GROUPS[-1])
