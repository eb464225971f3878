"""MMQ's launch rules (kernels/mmq.cu): int8 tensor-core tiles with split-k where the tiles are fewer than the SMs."""
from __future__ import annotations

import numpy as np

from .build import QTYPES, constants, kernel
from .config import current
from . import launch
from .weights import GPUWeight

_MMQ = constants("mmq")                   # the kernels' own #defines
MMQ_BM, MMQ_BN, MMQ_KT = _MMQ["MMQ_BM"], _MMQ["MMQ_BN"], _MMQ["MMQ_KT"]
MMQ_SMEM_BYTES, MMQK_SMEM_BYTES = _MMQ["MMQ_SMEM_BYTES"], _MMQ["MMQK_SMEM_BYTES"]
Q4_K = QTYPES["T_Q4_K"]
MMQ_MAX_SPLITS = 8


def should_use_mmq(w: GPUWeight, n: int, table: dict) -> bool:
    """Where the dispatch table measured MMQ faster than dequantize + cuBLAS for the type."""
    return n <= table["mmq_max"].get(int(w.type), table["mmq_default"])


def mmq_splits(m: int, n: int, k: int, slots: int, tile: tuple[int, int, int] = (MMQ_BM, MMQ_BN, MMQ_KT)) \
        -> tuple[int, int]:
    """(splits, stages per split) of split-k for a kernel of (rows, columns, k-values) tiles (MMQ, mmq_f16): where the
    output tiles are fewer than the block slots (SMs x blocks per SM), k's stages are cut into up to MMQ_MAX_SPLITS
    equal runs so that tiles x splits <= slots; none empty; config.mmq_splits asks for a count (1: none)."""
    stages = (k + tile[2] - 1) // tile[2]
    tiles = (m + tile[0] - 1) // tile[0] * ((n + tile[1] - 1) // tile[1])
    forced = current().mmq_splits
    splits = max(1, min(stages, forced if forced else min(MMQ_MAX_SPLITS, slots // tiles)))
    per = (stages + splits - 1) // splits
    return (stages + per - 1) // per, per


def mmq_kernel(t: int) -> tuple[str, int, int]:
    """(kernel, dynamic shared memory, blocks per SM it is sized for) of MMQ for type t: mmq_q4_K for Q4_K (unless
    config.mmq_q4_K is False), else mmq<t>."""
    if t == Q4_K and current().mmq_q4_K:
        return "mmq_q4_K", MMQK_SMEM_BYTES, 2
    return f"mmq<{t}>", MMQ_SMEM_BYTES, 1


def mmq_n_pad(n: int) -> int:
    """The columns MMQ's q8_1 activations are padded to for n columns: a multiple of MMQ_BN."""
    return (n + MMQ_BN - 1) // MMQ_BN * MMQ_BN


def mmq(w: GPUWeight, qs, ds, n: int, out=None):
    """y [n, m] = x W^T on int8 tensor cores; qs/ds padded to mmq_n_pad(n) columns."""
    name, smem, per_sm = mmq_kernel(int(w.type))
    return mmq_launch(kernel("mmq", name), kernel("mmq", "mmq_split_sum"), smem, per_sm, w, qs, ds, n, out)


def mmq_launch(fn, split_sum, smem: int, per_sm: int, w: GPUWeight, qs, ds, n: int, out=None):
    """mmq's launch rule with the kernels given (fn: an MMQ kernel sized for per_sm blocks per SM with smem bytes of
    shared memory; split_sum: mmq_split_sum), for benchmarks of kernels built with other settings."""
    cp = launch._cp()
    n_pad = qs.shape[0]
    assert n_pad % MMQ_BN == 0 and n <= n_pad
    y = out if out is not None else cp.empty((n, w.m), cp.float32)
    splits, per = mmq_splits(w.m, n_pad, w.k, launch._sm_count() * per_sm)
    grid = ((w.m + MMQ_BM - 1) // MMQ_BM, n_pad // MMQ_BN, splits)
    split_launch(fn, smem, grid, w, qs, ds, n, y, per, split_sum)
    return y


def split_launch(fn, smem: int, grid: tuple, w: GPUWeight, x, ds, n: int, y, per: int, split_sum=None) -> None:
    """Launch an MMQ-style kernel (fn: block 256, smem bytes of shared memory; arguments w, x, [ds,] y, m, n, k,
    row_bytes, stages per split; ds None for a kernel without activation scales) over grid = (row tiles, column
    tiles, splits); with more than one split, each writes its partial y and mmq_split_sum adds them in order."""
    cp = launch._cp()
    splits = grid[2]
    part = y if splits == 1 else cp.empty((splits, n, w.m), cp.float32)    # each split's partial y
    args = (w.data, x) + ((ds,) if ds is not None else ()) + (
        part, np.int32(w.m), np.int32(n), np.int32(w.k), np.int64(w.row_bytes), np.int32(per))
    launch.with_smem(fn, smem)(grid, (256,), args, shared_mem=smem)
    if splits > 1:
        nm = n * w.m
        (split_sum or kernel("mmq", "mmq_split_sum"))(((nm + 255) // 256,), (256,),
                                                      (part, y, np.int32(splits), np.int64(nm)))
