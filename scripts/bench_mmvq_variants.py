#!/usr/bin/env python3
"""Time MMVQ (kernels/mmvq.cu: mmvq, and mmvq_pieces for its types) built with other tuning knobs (MMVQ_UNROLL,
MMVQ_ROWS_1/_N/_HI, MMVQ_MIN_BLOCKS, MMVQP_*) at m = 4096, k = 14336, n = 1..8, for every thread-group split
(groups = 1, 2, 4), to choose the defaults; and a plain streaming read of the weights' bytes (the ceiling there).

    python scripts/bench_mmvq_variants.py [--types q4_K,q4_0,q6_K] [--variants mmvq,pieces] [--reps 30]

Each variant is compiled for one type at a time; its outputs are checked against the first variant's (the same sums
in another order: relative error < 1e-5). Kernel time: 10 back-to-back launches on preallocated buffers / 10, weights
rotated over copies that together exceed the L2; medians of reps.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels import TYPE_NAMES, K, M, time_batched, time_graph, warm_gpu  # noqa: E402

from engine.quants import TYPES, random_blocks  # noqa: E402

# (name, kernel, defines): per type, the first variant that applies is the reference (the defaults). mmvq: f = the
# chunk iterations ahead a thread prefetches weight lines into L1 at one column / at 2..8 (MMVQ_PREFETCH_1 / _N),
# "a2 halves" = the types with 2-byte aligned blocks (Q4_0, Q5_0, Q8_0, Q3_K, Q6_K, IQ4_NL) loading their quant
# bytes as 2-byte halves (A2_AS_WORDS=0, before; a no-op for the other types); "narrow" = Q4_K's header, Q5_K and
# IQ4_XS loading in 4-byte or narrower pieces (WIDE_LOADS=0, before; a no-op for the other types);
# mmvq_pieces (PIECE_QTYPES only): r = MMVQP_ROWS_1 / _N / _HI; mmvq_mma_q4_K (Q4_K only): w = MMVQM_WARPS,
# p = MMVQM_PAIRS; mmvq_q4_K_pairs (Q4_K only): pipe = MMVQ2_PIPE, r = MMVQ2_ROWS_1 / _N. Earlier sessions' knobs (MMVQ_UNROLL, MMVQ_ROWS_*,
# MMVQ_MIN_BLOCKS) are still there: their results are in BENCHMARKS.md.
VARIANTS = [(f"mmvq f{f1}/{fn}", "mmvq", dict(MMVQ_PREFETCH_1=f1, MMVQ_PREFETCH_N=fn))
            for f1, fn in ((0, 1), (0, 0))] + [
    ("mmvq a2 halves", "mmvq", dict(A2_AS_WORDS=0)), ("mmvq narrow", "mmvq", dict(WIDE_LOADS=0))] + [
    (f"pieces r{r}", "mmvq_pieces",
     dict(zip(("MMVQP_ROWS_1", "MMVQP_ROWS_N", "MMVQP_ROWS_HI"), map(int, r.split("/")))))
    for r in ("1/2/4", "2/2/2")] + [
    (f"mma w{w} p{u}", "mmvq_mma", dict(MMVQM_WARPS=w, MMVQM_PAIRS=u))
    for w, u in ((16, 2), (8, 2), (8, 4), (16, 1), (16, 4), (32, 1), (32, 2))] + [
    (f"pairs r{r1} b{mb}{' pipe' if pipe else ''}", "mmvq_pairs",
     dict(MMVQ2_ROWS_1=r1, MMVQ2_MIN_BLOCKS_1=mb, MMVQ2_PIPE=pipe))
    for r1, mb, pipe in ((1, 8, 0), (2, 8, 0), (2, 4, 0), (4, 8, 0), (4, 4, 0), (2, 4, 1))] + [
    ("mmvq r2", "mmvq", dict(MMVQ_ROWS_1=2))]


def applies(kernel: str, type_id: int) -> bool:
    from engine.cuda import launch
    return (kernel == "mmvq" or kernel == "mmvq_pieces" and type_id in launch.PIECE_TYPES
            or kernel in ("mmvq_mma", "mmvq_pairs") and type_id in launch.MMA_TYPES)


STREAM_READ = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ p, long long n16, unsigned* out) {
    unsigned acc = 0;
#pragma unroll 4
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = p[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;    // keeps the loads
}
"""


ROW_READ = r"""
extern "C" __global__ void row_read(const uint4* __restrict__ p, int rows, int row16, int tpr, unsigned* out) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x, row = t / tpr, lane = t % tpr;
    if (row >= rows) return;
    const uint4* r = p + (long long)row * row16;
    unsigned acc = 0;
    for (int i = lane; i < row16; i += tpr) {
        const uint4 v = r[i];
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
"""


def row_read(rows: int, row_bytes: int, reps: int) -> dict:
    """The same bytes read the way MMVQ walks them: a group of tpr threads per row, 16-byte loads strided by tpr
    within the row: {tpr: us} for tpr = 32, 64, 128."""
    import cupy as cp
    fn = cp.RawKernel(ROW_READ, "row_read")
    nbytes = rows * row_bytes
    bufs = [cp.ones(nbytes, cp.uint8) for _ in range(max(2, int(np.ceil(200e6 / nbytes))))]
    out = cp.zeros(1, cp.uint32)
    res = {}
    for tpr in (32, 64, 128):
        grid = ((rows * tpr + 127) // 128,)
        res[tpr] = time_batched(lambda b: fn(grid, (128,), (b, np.int32(rows), np.int32(row_bytes // 16),
                                                            np.int32(tpr), out)), bufs, reps)
    return res


def read_ceiling(nbytes: int, reps: int):
    """The fastest plain streaming read of nbytes (rotated over copies > L2) over a few launch shapes: (us, GB/s)."""
    import cupy as cp
    fn = cp.RawKernel(STREAM_READ, "stream_read")
    bufs = [cp.ones(nbytes // 16 * 16, cp.uint8) for _ in range(max(2, int(np.ceil(200e6 / nbytes))))]
    out = cp.zeros(1, cp.uint32)
    n16 = np.int64(nbytes // 16)
    best = None
    for blocks, threads in ((132 * 4, 256), (132 * 8, 256), (132 * 16, 128), (132 * 2, 1024), (int(n16) // 256, 256)):
        us = time_batched(lambda b: fn((blocks,), (threads,), (b, n16, out)), bufs, reps)
        best = us if best is None else min(best, us)
    return best, nbytes / (best * 1e-6) / 1e9


def build(type_id: int, kernel: str, defines: dict):
    import cupy as cp

    from engine.cuda.build import NVRTC_OPTIONS, QTYPES, expanded_source
    tname = next(k for k, v in QTYPES.items() if v == type_id)
    opts = NVRTC_OPTIONS + tuple(f"-D{k}={v}" for k, v in defines.items()) + (f"-DMMVQ_ONLY_TYPE={tname}",)
    opts += ("-DMMVQ_ONLY_PIECES",) if kernel == "mmvq_pieces" else ()
    opts += ("-DMMVQ_ONLY_PAIRS",) if kernel == "mmvq_pairs" else ()
    opts += ("-DMMVQ_SKIP_MMA",) if kernel != "mmvq_mma" else ()
    names = [f"mmvq_mma_q4_K<{n}, 0>" if kernel == "mmvq_mma" else f"mmvq_q4_K_pairs<{n}, 0>"
             if kernel == "mmvq_pairs" else f"{kernel}<{type_id}, {n}, 0>" for n in range(1, 9)]
    mod = cp.RawModule(code=expanded_source("mmvq"), options=opts, name_expressions=names)
    return {n: mod.get_function(names[n - 1]) for n in range(1, 9)}


def rows_for(kernel: str, defines: dict, n: int) -> int:
    from engine.cuda import launch
    if kernel == "mmvq_mma":
        return 16
    if kernel == "mmvq_pairs":
        return defines.get("MMVQ2_ROWS_1" if n == 1 else "MMVQ2_ROWS_N", launch.mmvq2_rows(n))
    pre = "MMVQP_ROWS" if kernel == "mmvq_pieces" else "MMVQ_ROWS"
    key = f"{pre}_1" if n == 1 else f"{pre}_N" if n <= 4 else f"{pre}_HI"
    return defines.get(key, launch.mmvqp_rows(n) if kernel == "mmvq_pieces" else launch.mmvq_rows(n))


def main():
    import cupy as cp

    from engine.cuda import launch
    from engine.cuda.weights import upload
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="q4_K,q4_0,q6_K,q8_0,q5_K")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--variants", default="", help="only the variants whose names start with one of these")
    ap.add_argument("--ns", default="1,2,3,4,5,6,7,8", help="column counts")
    ap.add_argument("--shapes", default=f"{M}x{K}", help="m x k shapes, e.g. 4096x14336,14336x4096")
    ap.add_argument("--graph", action="store_true", help="kernel times from CUDA graphs of 20 launches")
    args = ap.parse_args()
    wanted = [v for v in args.variants.split(",") if v]
    ns = [int(v) for v in args.ns.split(",")]
    shapes = [tuple(map(int, sh.split("x"))) for sh in args.shapes.split(",")]
    rng = np.random.default_rng()
    warm_gpu()
    results = []     # (shape, type, variant, n, groups, us, err)
    for m, k in shapes:
        for tname in args.types.split(","):
            t = TYPE_NAMES[tname]
            blocks = random_blocks(t, m * k // TYPES[t].block_size, rng)
            w0 = upload(t, (m, k), blocks)
            ws = [w0] + [upload(t, (m, k), blocks) for _ in range(max(1, int(np.ceil(200e6 / w0.nbytes)) - 1))]
            q8 = {n: launch.quantize_q8_1(cp.asarray(rng.standard_normal((n, k)).astype(np.float32))) for n in ns}
            ref = {}
            for vname, kname, defines in VARIANTS:
                if not applies(kname, int(t)) or wanted and not any(vname.startswith(v) for v in wanted):
                    continue
                fns = build(int(t), kname, defines)
                warm_gpu(0.5)                                # the clocks fall while NVRTC compiles
                for n in ns:
                    qs, ds = q8[n]
                    mma = kname == "mmvq_mma"
                    threads = 32 * defines["MMVQM_WARPS"] if mma else launch.MMVQ_THREADS
                    for groups in (1,) if mma else (1, 2, 4):
                        out = cp.zeros((n, m), cp.float32)
                        rows = rows_for(kname, defines, n)
                        grid = ((m + groups * rows - 1) // (groups * rows),)

                        def call(wi, fn=fns[n], grid=grid, out=out, qs=qs, ds=ds, groups=groups, threads=threads):
                            fn(grid, (threads,), launch.mmvq_args([wi], qs, ds, [out], groups))
                        call(w0)
                        y = out.get()
                        if n not in ref:
                            ref[n] = y
                        err = float(np.abs(y - ref[n]).max() / np.abs(ref[n]).max())
                        timer = time_graph if args.graph else time_batched
                        timer(call, ws, 5)                   # warm-up
                        us = timer(call, ws, args.reps)
                        results.append(((m, k), tname, vname, n, groups, us, err))
            del ws, w0
            cp.get_default_memory_pool().free_all_blocks()

    if (M, K) in shapes:
        for tname in args.types.split(","):
            info = TYPES[TYPE_NAMES[tname]]
            us, gbs = read_ceiling(M * K // info.block_size * info.type_size, args.reps)
            print(f"plain streaming read of the {tname} weights' size: {us:.1f} us, {gbs:.0f} GB/s")
            row_bytes = K // info.block_size * info.type_size
            if row_bytes % 16 == 0:
                rr = row_read(M, row_bytes, args.reps)
                print("  read row by row (tpr threads per row, as MMVQ walks it): " +
                      ", ".join(f"tpr {t}: {us:.1f} us" for t, us in rr.items()))
    for m, k in shapes:
        print(f"\nm = {m}, k = {k}; kernel us, best of groups 1/2/4 (the group count in brackets; all three at the "
              f"first n in the last column); medians of {args.reps}")
        for tname in args.types.split(","):
            nbytes = m * k // TYPES[TYPE_NAMES[tname]].block_size * TYPES[TYPE_NAMES[tname]].type_size
            print(f"\n{tname}: weights {nbytes / 1e6:.1f} MB")
            print("| variant | " + " | ".join(f"n={n}" for n in ns) + f" | n={ns[0]} GB/s | n={ns[-1]} / n={ns[0]} |"
                  f" max rel err | n={ns[0]} by groups |")
            print("| --- " * (len(ns) + 5) + "|")
            for vname, _, _ in VARIANTS:
                rs = [r for r in results if r[0] == (m, k) and r[1] == tname and r[2] == vname]
                if not rs:
                    continue
                best = {n: min((r for r in rs if r[3] == n), key=lambda r: r[5]) for n in ns}
                err = max(r[6] for r in rs)
                by_groups = " / ".join(f"{r[5]:.1f}" for r in rs if r[3] == ns[0])
                print(f"| {vname} | " + " | ".join(f"{best[n][5]:.1f} ({best[n][4]})" for n in ns) +
                      f" | {nbytes / (best[ns[0]][5] * 1e-6) / 1e9:.0f} | {best[ns[-1]][5] / best[ns[0]][5]:.2f} |"
                      f" {err:.1e} | {by_groups} |")


if __name__ == "__main__":
    main()
