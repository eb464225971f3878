"""mmq_f16's launch rules (kernels/mmq_f16.cu): raw weight blocks unpacked to f16 in shared memory and multiplied on
f16 tensor cores with f16 activations, split-k (MMQ's rule) where its tiles are fewer than the SMs."""
from __future__ import annotations

from .build import MMQ_F16_BN, constants, kernel
from . import launch
from .mmq import mmq_splits, split_launch
from .weights import GPUWeight

_MF = constants("mmq_f16")                # the kernel's own #defines
MF_BM, MF_KT = _MF["MF_BM"], _MF["MF_KT"]
SMEM_BYTES = {bn: _MF[f"MF_SMEM_BYTES_{bn}"] for bn in MMQ_F16_BN}


def column_tile(n: int) -> int:
    """The columns one block takes: the smallest of MMQ_F16_BN holding n, else the largest."""
    return next((bn for bn in MMQ_F16_BN if bn >= n), MMQ_F16_BN[-1])


def should_use_mmq_f16(w: GPUWeight, n: int, table: dict) -> bool:
    """Where the dispatch table measured mmq_f16 the fastest of the paths above MMVQ for the type."""
    return n <= table["mmq_f16_max"].get(int(w.type), table["mmq_f16_default"])


def mmq_f16(w: GPUWeight, x16, out=None):
    """y [n, m] f32 = x16 [n, k] f16 (contiguous) W^T, W in its quantized blocks."""
    cp = launch._cp()
    x16 = cp.ascontiguousarray(x16, dtype=cp.float16)
    n = x16.shape[0]
    y = out if out is not None else cp.empty((n, w.m), cp.float32)
    bn = column_tile(n)
    splits, per = mmq_splits(w.m, n, w.k, launch._sm_count(), (MF_BM, bn, MF_KT))
    grid = ((w.m + MF_BM - 1) // MF_BM, (n + bn - 1) // bn, splits)
    split_launch(kernel("mmq_f16", f"mmq_f16<{int(w.type)}, {bn}>"), SMEM_BYTES[bn], grid, w, x16, None, n, y, per)
    return y
