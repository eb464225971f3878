"""MMVQ's launch rules (kernels/mmvq.cu): which kernel takes a mul_mat of few columns, its blocks and k ranges, and
the launches (one Python function per kernel launch, shapes checked)."""
from __future__ import annotations

import functools

import numpy as np

from .build import QTYPES, TC_WIDE_NCOLS, constants, kernel
from .config import current
from . import launch
from .weights import GPUWeight

_MMVQ = constants("mmvq")                 # the kernels' own #defines
MMVQ_THREADS = _MMVQ["MMVQ_THREADS"]


def mmvq_rows(ncols: int) -> int:
    """Rows each MMVQ thread group serves (kernels/mmvq.cu mmvq_rows)."""
    return _MMVQ["MMVQ_ROWS_1"] if ncols == 1 else _MMVQ["MMVQ_ROWS_N"]


def mmvqp_rows(ncols: int, glu: int = 0) -> int:
    """Output rows each mmvq_pieces thread group serves (kernels/mmvq.cu mmvqp_rows)."""
    rows = _MMVQ["MMVQP_ROWS_1"] if ncols == 1 else _MMVQ["MMVQP_ROWS_N"] if ncols <= 4 else _MMVQ["MMVQP_ROWS_HI"]
    return (rows + 1) // 2 if glu else rows


def mmvq2_rows(ncols: int, exact: bool = False) -> int:
    """Rows each mmvq_q4_K_pairs thread group serves (kernels/mmvq.cu mmvq2_rows; exact: its EXACT instances)."""
    return _MMVQ["MMVQ2_ROWS_EXACT"] if exact else _MMVQ["MMVQ2_ROWS_1"] if ncols == 1 else _MMVQ["MMVQ2_ROWS_N"]


Q4_K, Q6_K = QTYPES["T_Q4_K"], QTYPES["T_Q6_K"]
PIECES_MIN_COLS = 5             # Q4_K takes mmvq_pieces from this many columns (mmvq is faster below)
PAIRS_MAX_COLS = 1              # Q4_K takes mmvq_q4_K_pairs at up to this many columns (at 2: a wash, BENCHMARKS.md)
# Q4_K's mmvq_tc_q4_K: at 9..64 columns, and from TC_MIN_COLS columns where the launch reads at least TC_MIN_WEIGHTS
# weights (H200, graph-timed, BENCHMARKS.md: 4096 x 14336 and 14336 x 4096 at n = 3..8 16.4-19.6 us against mmvq's
# 18.0-37.0; at <= 16.7 M weights (4096 x 4096, 8192 x 2048, ...) mmvq is faster at every n up to 8). At 2 columns
# only where k >= TC_2COL_K_PER_ROW x the rows (4096 x 14336 14.5 against mmvq's 16.0-16.4 us; 14336 x 4096 15.6-16.9
# against 15.0).
TC_ALL_COLS = 9
TC_MIN_COLS = 3
TC_MIN_WEIGHTS = 32 << 20
TC_2COL_K_PER_ROW = 2
MMVQT_WARPS = _MMVQ["MMVQT_WARPS"]                  # warps (16-row tiles) per mmvq_tc_q4_K block
MMVQT_BLOCKS_PER_SM = _MMVQ["MMVQT_MIN_BLOCKS"]     # its blocks an SM holds (128 registers per thread)
MMVQT_WIDE_FROM = _MMVQ["MMVQT_WIDE_FROM"]          # ... from this many columns to 8: twice the warps, one block per SM
MMVQT_MAX_RANGE = _MMVQ["MMVQT_MAX_RANGE"]          # super-blocks per k range at most (its shared memory)
MMVQT_WIN_LD = _MMVQ["MMVQT_WIN_LD"]                # bytes of a row of a warp's window of weight lines
TC_MAX_COLS = TC_WIDE_NCOLS[-1]                     # mmvq_tc_q4_K takes up to this many columns in one launch, past
                                                    # 16 as the kernel of the next of build.TC_WIDE_NCOLS
MMVQT_SMEM_MAX = 227 * 1024                         # an sm_90 block's dynamic shared memory at most
MMVQ_MAX_COLS = 16      # columns a mul_mat of a type without the tensor-core kernel takes on MMVQ (launches of 8)
KERNEL_MAX_COLS = 8     # columns mmvq and mmvq_pieces take per launch
INVARIANT_MAX_COLS = 1 << 20    # columns an MMVQ mul_mat takes in batch-invariant mode (every prefill ubatch)
# Columns up to which mmvq and mmvq_q4_K_pairs take 16-bit activations (q8_1 and its residual plane, their EXACT
# instances) where CudaConfig.exact_decode: one sequence's decode step, the path its fidelity is measured on
# (BENCHMARKS.md, Fidelity).
RESIDUAL_MAX_COLS = 1


def should_use_mmvq(w: GPUWeight, n: int, table: dict) -> bool:
    """A quantized type the kernels know, at up to the dispatch table's column count for it and what the kernels
    take (mmvq_max_cols)."""
    return n <= min(table["mmvq_max"].get(int(w.type), table["mmvq_default"]), mmvq_max_cols(int(w.type)))


def _q4_K_forced(kernel_name: str) -> bool | None:
    """True / False where config.mmvq_q4_K forces Q4_K's MMVQ kernel to be / not be kernel_name; None: the rule."""
    forced = current().mmvq_q4_K
    return None if forced is None else forced == kernel_name


def _q4_K_own(t: int) -> bool:
    """Whether Q4_K's own MMVQ kernels (tc, pieces, pairs) may serve type t: Q4_K, outside batch-invariant mode
    (where every type takes the generic mmvq)."""
    return t == Q4_K and not current().batch_invariant


def _use_tc(t: int, n: int, weights: int = 0, k: int = 0) -> bool:
    """mmvq_tc_q4_K for Q4_K at >= TC_ALL_COLS columns, or >= TC_MIN_COLS (2 where k >= TC_2COL_K_PER_ROW x the rows)
    where the launch reads >= TC_MIN_WEIGHTS weights (weights: its matrices' rows x k)."""
    if not _q4_K_own(t):
        return False
    forced = _q4_K_forced("tc")
    if forced is not None:
        return forced
    long_rows = k > 0 and k * k >= TC_2COL_K_PER_ROW * weights               # k >= 2 x (weights / k) rows
    min_cols = 2 if long_rows else TC_MIN_COLS
    return n >= TC_ALL_COLS or (n >= min_cols and weights >= TC_MIN_WEIGHTS)


def _use_pieces(t: int, n: int) -> bool:
    forced = _q4_K_forced("pieces")
    return _q4_K_own(t) and (n >= PIECES_MIN_COLS if forced is None else forced)


def _use_pairs(t: int, n: int) -> bool:
    forced = _q4_K_forced("pairs")
    return _q4_K_own(t) and n <= PAIRS_MAX_COLS and (True if forced is None else forced)


def _use_q6_K(t: int, n: int, glu: int, rows: int) -> bool:
    """mmvq_q6_K: Q6_K at one column without a GLU epilogue, outside batch-invariant mode, in launches of at least
    Q6_K_MIN_ROWS rows."""
    return t == Q6_K and n == 1 and not glu and rows >= Q6_K_MIN_ROWS and not current().batch_invariant


Q6_K_ROWS = 2           # rows each warp of mmvq_q6_K serves (its NR): 1 was nowhere faster (BENCHMARKS.md)
Q6_K_MIN_ROWS = 8192    # below it the generic kernel was faster (4,096 x 14,336: 22.0 against 23.6 us, H100)


def takes_residual(t: int, n: int) -> bool:
    """Whether an MMVQ mul_mat of type t at n columns runs on 16-bit activations (an EXACT kernel instance, reading
    the residual plane): CudaConfig.exact_decode, n <= RESIDUAL_MAX_COLS and a kernel that has them (mmvq, pairs,
    mmvq_q6_K)."""
    return (current().exact_decode and n <= RESIDUAL_MAX_COLS and not _use_tc(t, n) and not _use_pieces(t, n))


def _mmvqt_wide(ncols: int) -> bool:
    return MMVQT_WIDE_FROM <= ncols <= 8


def mmvqt_ncols(n: int) -> int:
    """The NCOLS of the mmvq_tc_q4_K kernel that takes n columns: n up to 16, past it the next of TC_WIDE_NCOLS."""
    return n if n <= 16 else next(c for c in TC_WIDE_NCOLS if c >= n)


def mmvq_max_cols(t: int) -> int:
    """Columns one MMVQ mul_mat of type t takes at most: TC_MAX_COLS where mmvq_tc_q4_K serves it, else
    MMVQ_MAX_COLS; any number in batch-invariant mode (launches of KERNEL_MAX_COLS, CudaConfig.batch_invariant)."""
    if current().batch_invariant:
        return INVARIANT_MAX_COLS
    return TC_MAX_COLS if _use_tc(t, TC_MAX_COLS) else MMVQ_MAX_COLS


def mmvqt_max_range(ncols: int) -> int:
    """Super-blocks per k range of an mmvq_tc_q4_K launch at ncols (a kernel's NCOLS) at most: MMVQT_MAX_RANGE, or
    past 16 columns as many as its shared memory holds."""
    per = MMVQT_MAX_RANGE
    while ncols > 16 and per > 1 and mmvqt_smem_bytes(256 * per, ncols, 1) > MMVQT_SMEM_MAX:
        per -= 1
    return per


def mmvqt_warps(ncols: int) -> int:
    """Warps (16-row tiles) per mmvq_tc_q4_K block at ncols columns (kernels/mmvq.cu mmvqt_warps)."""
    return 2 * MMVQT_WARPS if _mmvqt_wide(ncols) else MMVQT_WARPS


def mmvqt_sums_cols(ncols: int) -> int:
    """Floats per row of an mmvq_tc_q4_K block's sums (kernels/mmvq.cu mmvqt_sums_cols): past 2 columns, padded
    to 4."""
    return -(-ncols // 4) * 4 if ncols > 2 else ncols


def mmvqt_rows(glu: int, ncols: int) -> int:
    """Output rows per mmvq_tc_q4_K block: a 16-row tile per warp (GLU: per two warps, the gate's and the up's)."""
    return 16 * mmvqt_warps(ncols) // (2 if glu else 1)


def mmvqt_splits(row_blocks: int, k: int, ncols: int) -> int:
    """k ranges of an mmvq_tc_q4_K launch of row_blocks row blocks at ncols columns (a kernel's NCOLS): enough blocks
    to fill the SMs' block slots, each range at most mmvqt_max_range(ncols) super-blocks, none empty;
    config.mmvq_tc_splits asks for a count."""
    nsb = k // 256
    forced = current().mmvq_tc_splits
    per_sm = 1 if _mmvqt_wide(ncols) or ncols > 16 else MMVQT_BLOCKS_PER_SM
    want = forced if forced else round(launch._sm_count() * per_sm / row_blocks)
    splits = min(nsb, max(1, want, -(-nsb // mmvqt_max_range(ncols))))
    per = -(-nsb // splits)
    return -(-nsb // per)


def mmvqt_smem_bytes(k: int, ncols: int, splits: int) -> int:
    """kernels/mmvq.cu mmvq_tc_q4_K's dynamic shared memory: its k range's activations (32 bytes per chunk and
    column of its B tiles) with their d_x and d_x sum x, the warps' tile sums, then the warps' windows of weight
    lines (16 rows of MMVQT_WIN_LD bytes)."""
    nsb = k // 256
    chunks, cols = -(-nsb // splits) * 8, (ncols + 7) // 8 * 8
    return chunks * cols * (32 + 8) + mmvqt_warps(ncols) * (16 * mmvqt_sums_cols(ncols) * 4 + 16 * MMVQT_WIN_LD)


_tc_scratch: list = []                  # (partial sums, counters) of mmvq_tc_q4_K, kept: graphs hold their addresses


def _mmvqt_scratch(part_floats: int, row_blocks: int) -> tuple:
    """A partial-sum buffer of at least part_floats floats and row_blocks zeroed counters (the kernel leaves them
    zero), reused by every launch on the stream; a larger pair is made when needed, the old ones kept. Taken from
    CuPy's default pool whatever allocator is current (a CUDA graph's private pool goes when its graph does)."""
    cp = launch._cp()
    if not _tc_scratch or _tc_scratch[-1][0].size < part_floats or _tc_scratch[-1][1].size < row_blocks:
        pool = cp.get_default_memory_pool()
        size = max(part_floats, 1 << 20, 2 * _tc_scratch[-1][0].size if _tc_scratch else 0)
        n_counters = max(row_blocks, 1 << 14)
        counters = cp.ndarray((n_counters,), cp.int32, pool.malloc(4 * n_counters))
        counters.fill(0)
        _tc_scratch.append((cp.ndarray((size,), cp.float32, pool.malloc(4 * size)), counters))
    return _tc_scratch[-1]


GROUPS_BY_ROWS = frozenset({2, 3, 12})      # Q4_0, Q4_1, Q4_K: _mmvq_groups also looks at the rows (measured)


def _mmvq_groups(t: int, m: int, k: int) -> int:
    """Row groups per 128-thread mmvq block for type t, m rows in all (the launch's matrices) and k: enough threads per
    row for k, and for the 4-bit types more rows per block the more rows there are (measured on
    the H200: q4_K 14336 x 4096 at one column 19.2 us with 1 group, 14.1 with 4; 1024 x 4096 fastest with 1)."""
    chunks = k // 32
    groups = 1 if chunks >= 128 else 2 if chunks >= 64 else 4     # 128, 64 or 32 threads per group of rows
    if t in GROUPS_BY_ROWS:
        groups = max(groups, 4 if m >= 4096 else 2 if m >= 2048 else 1)
    return groups


def _mmvqp_groups(t: int, m: int, k: int) -> int:
    """Row groups per 128-thread mmvq_pieces block (measured, BENCHMARKS.md): by rows, one warp per row group
    where a row has few pieces."""
    if k // 16 < 128:
        return 4
    return 4 if m >= 8192 else 2 if m >= 4096 else 1


def _mmvq2_groups(t: int, m: int, k: int) -> int:
    """Row groups per 128-thread mmvq_q4_K_pairs or mmvq_q6_K block: one warp per row group."""
    return 4


def mmvq_choice(t: int, n: int, glu: int, weights: int = 0, k: int = 0, exact: bool = False) -> tuple:
    """(kernel name, output rows per group, groups function, threads per block) of the MMVQ kernel for type t at n
    columns (glu: 0, or 1 / 2 for the silu / gelu epilogue) in a launch reading `weights` weights (rows x k); exact:
    its instance on 16-bit activations (takes_residual). For mmvq_tc_q4_K: its rows per block, no groups function and
    no threads (mmvq_launches has its launch rule)."""
    if _use_tc(t, n, weights, k):
        assert not exact
        return f"mmvq_tc_q4_K<{mmvqt_ncols(n)}, {glu}>", mmvqt_rows(glu, mmvqt_ncols(n)), None, None
    if _use_pieces(t, n):
        assert not exact
        return f"mmvq_pieces<{t}, {n}, {glu}>", mmvqp_rows(n, glu), _mmvqp_groups, MMVQ_THREADS
    if _use_q6_K(t, n, glu, weights // k if k else 0):
        return f"mmvq_q6_K<{Q6_K_ROWS}, {int(exact)}>", Q6_K_ROWS, _mmvq2_groups, MMVQ_THREADS
    if _use_pairs(t, n):
        return (f"mmvq_q4_K_pairs<{n}, {glu}, {int(exact)}>", 1 if glu else mmvq2_rows(n, exact), _mmvq2_groups,
                MMVQ_THREADS)
    return f"mmvq<{t}, {n}, {glu}, {int(exact)}>", 1 if glu else mmvq_rows(n), _mmvq_groups, MMVQ_THREADS


def _mmvq_kernel(t: int, n: int, glu: int, weights: int, k: int, exact: bool) -> tuple:
    name, rows, groups_for, threads = mmvq_choice(t, n, glu, weights, k, exact)
    return kernel("mmvq", name), rows, groups_for, threads


def column_groups(t: int, n: int) -> list[tuple[int, int]]:
    """(first column, columns) of each MMVQ launch for type t at n <= mmvq_max_cols(t) columns: one launch where a kernel
    takes all n, else groups of KERNEL_MAX_COLS (each reads the weights again)."""
    if not 1 <= n <= mmvq_max_cols(t):
        raise ValueError(f"MMVQ takes 1..{mmvq_max_cols(t)} columns of this type, not {n}")
    if n <= KERNEL_MAX_COLS or _use_tc(t, n):
        return [(0, n)]
    return [(j, min(KERNEL_MAX_COLS, n - j)) for j in range(0, n, KERNEL_MAX_COLS)]


def mmvq(w: GPUWeight, qs, ds, n: int, out=None, rs=None):
    """y [n, m] = x W^T for n <= mmvq_max_cols(w.type) columns (activations from quantize_q8_1; rs: their residual
    plane, where takes_residual)."""
    return mmvq_multi([w], qs, ds, n, [out], rs)[0]


def mmvq_multi(ws: list[GPUWeight], qs, ds, n: int, outs=None, rs=None):
    """[x W^T for W in ws] in one launch: up to 3 matrices of one type and k (q, k, v) -> list of [n, m_i]."""
    cp = launch._cp()
    outs = outs or [None] * len(ws)
    ys = [o if o is not None else cp.empty((n, w.m), cp.float32) for w, o in zip(ws, outs)]
    for fn, grid, block, args in mmvq_launches(ws, qs, ds, n, ys, rs=rs):
        fn(grid, block, args)
    return ys


def mmvq_launches(ws: list[GPUWeight], qs, ds, n: int, ys: list, glu: int = 0, rs=None) -> list[tuple]:
    """[(kernel, grid, block, args)] of mmvq_multi's launches into ys, one per column group (a benchmark repeats them
    without the Python work); with glu (GLU_ACTS), mmvq_glu's: ws = [gate, up] into ys = [y]. rs: the activations'
    residual plane, given exactly where takes_residual (the kernels' EXACT instances)."""
    assert 1 <= len(ws) <= 3 and len({(int(w.type), w.k) for w in ws}) == 1
    t, k = int(ws[0].type), ws[0].k
    exact = rs is not None
    if exact != takes_residual(t, n):
        raise ValueError(f"MMVQ of type {t} at {n} columns takes {'' if takes_residual(t, n) else 'no '}residual plane")
    served = ws[:1] if glu else ws                    # GLU: each output row dots a gate row and an up row
    launches = []
    for j, nj in column_groups(t, n):
        fn, rows, groups_for, threads = _mmvq_kernel(t, nj, glu, sum(w.m for w in ws) * k, k, exact)
        xs = (qs[j:j + nj], ds[j:j + nj], rs[j:j + nj] if exact else None, [y[j:j + nj] for y in ys])
        if groups_for is None:                        # mmvq_tc_q4_K: row blocks x k ranges, partial sums, counters
            nt = mmvqt_ncols(nj)
            row_blocks = sum((w.m + rows - 1) // rows for w in served)
            splits = mmvqt_splits(row_blocks, k, nt)
            smem = mmvqt_smem_bytes(k, nt, splits)
            part, counters = _mmvqt_scratch(row_blocks * splits * mmvqt_rows(0, nt) * mmvqt_sums_cols(nt), row_blocks)
            launches.append((functools.partial(launch.with_smem(fn, smem), shared_mem=smem), (row_blocks, splits),
                             (32 * mmvqt_warps(nt),), mmvq_args(ws, *xs, splits, bool(glu)) + (part, counters,
                                                                                            np.int32(nj))))
            continue
        groups = groups_for(t, sum(w.m for w in served), k)
        per_block = groups * rows
        grid = (sum((w.m + per_block - 1) // per_block for w in served),)
        launches.append((fn, grid, (threads,), mmvq_args(ws, *xs, groups, bool(glu))))
    return launches


def mmvq_args(ws: list[GPUWeight], qs, ds, rs, ys: list, groups: int, glu: bool = False) -> tuple:
    """The arguments every MMVQ kernel takes (kernels/mmvq.cu MMVQ_PARAMS): up to 3 matrices of one type and k
    multiplied by the q8_1 activations (qs, ds; rs their residual plane or None) into ys, absent ones as null pointers
    with 0 rows; with glu, the gate and up matrices into one output (only the gate's rows given: m1 = 0)."""
    def padded(xs, fill):
        return list(xs) + [fill] * (3 - len(xs))
    ms = [ws[0].m] if glu else [w.m for w in ws]
    return (*padded([w.data for w in ws], np.uint64(0)), qs, ds, np.uint64(0) if rs is None else rs,
            *padded(ys, np.uint64(0)),
            *padded([np.int32(m) for m in ms], np.int32(0)), np.int32(ws[0].k), np.int64(ws[0].row_bytes),
            np.int32(groups))


GLU_ACTS = {"silu": 1, "gelu": 2}


def mmvq_glu(gate: GPUWeight, up: GPUWeight, qs, ds, n: int, act: str, out=None, rs=None):
    """y [n, m] = act(x gate^T) * (x up^T) in one launch (gate and up of one type and shape)."""
    cp = launch._cp()
    assert (int(gate.type), gate.m, gate.k) == (int(up.type), up.m, up.k)
    y = out if out is not None else cp.empty((n, gate.m), cp.float32)
    for fn, grid, block, args in mmvq_launches([gate, up], qs, ds, n, [y], GLU_ACTS[act], rs):
        fn(grid, block, args)
    return y
