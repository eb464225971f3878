"""mmq_f16's launch rules (kernels/mmq_f16.cu): raw weight blocks multiplied on f16 tensor cores with f16 activations,
split-k (MMQ's rule) where the tiles are fewer than the block slots. Up to SMALL_MAX_COLS columns of a matrix of at
least SMALL_MIN_WEIGHTS weights mmq_f16_small unpacks them in registers; else mmq_f16 to an f16 tile in shared
memory."""
from __future__ import annotations

from .build import MMQ_F16_BN, MMQ_F16_SMALL_NB, constants, kernel, mmq_f16_small_name, mmq_f16_small_plan
from . import launch
from .mmq import mmq_splits, split_launch
from .weights import GPUWeight

_MF = constants("mmq_f16")                # the kernel's own #defines
MF_BM, MF_KT, MFS_KT = _MF["MF_BM"], _MF["MF_KT"], _MF["MFS_KT"]
SMEM_BYTES = {bn: _MF[f"MF_SMEM_BYTES_{bn}"] for bn in MMQ_F16_BN}
SMALL_MAX_COLS = 8 * MMQ_F16_SMALL_NB[-1]
# mmq_f16_small serves launches of up to SMALL_MAX_COLS columns reading at least this many weights (the synthetic 8B's
# 4096 x 4096 and up); smaller ones keep the 64-column tiles (on SmolLM2's 576-wide matrices its split-k launches cost
# more than they save: batched decode 17 % slower at 16 and 64 sequences, BENCHMARKS.md)
SMALL_MIN_WEIGHTS = 16 << 20


def column_tile(n: int) -> int:
    """The columns one mmq_f16 block takes: the smallest of MMQ_F16_BN holding n, else the largest."""
    return next((bn for bn in MMQ_F16_BN if bn >= n), MMQ_F16_BN[-1])


def is_large(w: GPUWeight) -> bool:
    """Whether w has at least SMALL_MIN_WEIGHTS weights (mmq_f16_small's matrices; dispatch.THRESHOLDS_LARGE's)."""
    return w.m * w.k >= SMALL_MIN_WEIGHTS


def takes_small(w: GPUWeight, n: int) -> bool:
    """Whether mmq_f16 runs mmq_f16_small for w at n columns."""
    return n <= SMALL_MAX_COLS and is_large(w)


def small_tiles(n: int) -> int:
    """The 8-column B tiles of the mmq_f16_small kernel that takes n <= SMALL_MAX_COLS columns: the fewest holding n."""
    return next(nb for nb in MMQ_F16_SMALL_NB if 8 * nb >= n)


def small_smem_bytes(t: int, nb: int) -> int:
    """mmq_f16_small's dynamic shared memory for type t and nb B tiles: its stage buffers."""
    plan = mmq_f16_small_plan(t, nb)
    return plan.stages * plan.stage_bytes


def should_use_mmq_f16(w: GPUWeight, n: int, table: dict) -> bool:
    """Where the dispatch table measured mmq_f16 the fastest of the paths above MMVQ for the type."""
    return n <= table["mmq_f16_max"].get(int(w.type), table["mmq_f16_default"])


def mmq_f16(w: GPUWeight, x16, out=None):
    """y [n, m] f32 = x16 [n, k] f16 (contiguous) W^T, W in its quantized blocks."""
    cp = launch._cp()
    x16 = cp.ascontiguousarray(x16, dtype=cp.float16)
    n, t = x16.shape[0], int(w.type)
    y = out if out is not None else cp.empty((n, w.m), cp.float32)
    if takes_small(w, n):
        nb = small_tiles(n)
        per_sm = mmq_f16_small_plan(t, nb).per_sm
        splits, per = mmq_splits(w.m, n, w.k, launch._sm_count() * per_sm, (MF_BM, 8 * nb, MFS_KT))
        grid = ((w.m + MF_BM - 1) // MF_BM, (n + 8 * nb - 1) // (8 * nb), splits)
        split_launch(kernel("mmq_f16", mmq_f16_small_name(t, nb)), small_smem_bytes(t, nb), grid, w, x16,
                     None, n, y, per)
        return y
    bn = column_tile(n)
    splits, per = mmq_splits(w.m, n, w.k, launch._sm_count(), (MF_BM, bn, MF_KT))
    grid = ((w.m + MF_BM - 1) // MF_BM, (n + bn - 1) // bn, splits)
    split_launch(kernel("mmq_f16", f"mmq_f16<{t}, {bn}>"), SMEM_BYTES[bn], grid, w, x16, None, n, y, per)
    return y
