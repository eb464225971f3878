#!/usr/bin/env python3
"""Time MMVQ built with other tuning knobs (kernels/mmvq.cu: MMVQ_UNROLL, MMVQ_ROWS_1/_N/_HI, MMVQ_MIN_BLOCKS)
at m = 4096, k = 14336, n = 1..8, for every thread-group split (groups = 1, 2, 4), to choose the defaults; and a plain
streaming read of the weights' bytes (the ceiling at that size).

    python scripts/bench_mmvq_variants.py [--types q4_K,q4_0,q6_K] [--reps 30]

Each variant is compiled for one type at a time; its outputs are checked against the first variant's (the same sums
in another order: relative error < 1e-5). Kernel time: 10 back-to-back launches on preallocated buffers / 10, weights
rotated over copies that together exceed the L2; medians of reps.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels import TYPE_NAMES, K, M, time_batched  # noqa: E402

from engine.quants import TYPES, random_blocks  # noqa: E402

# (name, defines): the first (the defaults) is the reference; u = MMVQ_UNROLL, r = MMVQ_ROWS_1 / _N / _HI,
# b = MMVQ_MIN_BLOCKS (blocks per SM the register allocation must allow)
VARIANTS = [
    ("u1 r1/2/2 b4", dict(MMVQ_UNROLL=1, MMVQ_ROWS_1=1, MMVQ_ROWS_N=2, MMVQ_ROWS_HI=2, MMVQ_MIN_BLOCKS=4)),
    ("u1 r1/2/2 b1", dict(MMVQ_UNROLL=1, MMVQ_ROWS_1=1, MMVQ_ROWS_N=2, MMVQ_ROWS_HI=2, MMVQ_MIN_BLOCKS=1)),
    ("u2 r2/2/2 b4", dict(MMVQ_UNROLL=2, MMVQ_ROWS_1=2, MMVQ_ROWS_N=2, MMVQ_ROWS_HI=2, MMVQ_MIN_BLOCKS=4)),
    ("u1 r1/4/4 b4", dict(MMVQ_UNROLL=1, MMVQ_ROWS_1=1, MMVQ_ROWS_N=4, MMVQ_ROWS_HI=4, MMVQ_MIN_BLOCKS=4)),
    ("u1 r1/2/2 b6", dict(MMVQ_UNROLL=1, MMVQ_ROWS_1=1, MMVQ_ROWS_N=2, MMVQ_ROWS_HI=2, MMVQ_MIN_BLOCKS=6)),
]

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


def build(type_id: int, defines: dict):
    import cupy as cp

    from engine.cuda.build import NVRTC_OPTIONS, QTYPES, expanded_source
    tname = next(k for k, v in QTYPES.items() if v == type_id)
    opts = NVRTC_OPTIONS + tuple(f"-D{k}={v}" for k, v in defines.items()) + (f"-DMMVQ_ONLY_TYPE={tname}",)
    names = [f"mmvq<{type_id}, {n}, 0>" for n in range(1, 9)]
    mod = cp.RawModule(code=expanded_source("mmvq"), options=opts, name_expressions=names)
    return {n: mod.get_function(names[n - 1]) for n in range(1, 9)}


def rows_for(defines: dict, n: int) -> int:
    return defines["MMVQ_ROWS_1"] if n == 1 else defines["MMVQ_ROWS_N"] if n <= 4 else defines["MMVQ_ROWS_HI"]


def main():
    import cupy as cp

    from engine.cuda import launch
    from engine.cuda.weights import upload
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", default="q4_K,q4_0,q6_K")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    rng = np.random.default_rng()
    results = []     # (type, variant, n, groups, us)
    for tname in args.types.split(","):
        t = TYPE_NAMES[tname]
        blocks = random_blocks(t, M * K // TYPES[t].block_size, rng)
        w0 = upload(t, (M, K), blocks)
        ws = [w0] + [upload(t, (M, K), blocks) for _ in range(max(1, int(np.ceil(200e6 / w0.nbytes)) - 1))]
        xs = {n: cp.asarray(rng.standard_normal((n, K)).astype(np.float32)) for n in range(1, 9)}
        q8 = {n: launch.quantize_q8_1(xs[n]) for n in range(1, 9)}
        ref = {}
        for vname, defines in VARIANTS:
            fns = build(int(t), defines)
            for n in range(1, 9):
                qs, ds = q8[n]
                for groups in (1, 2, 4):
                    out = cp.zeros((n, M), cp.float32)
                    grid = ((M + groups * rows_for(defines, n) - 1) // (groups * rows_for(defines, n)),)
                    null = np.uint64(0)

                    def call(wi, fn=fns[n], grid=grid, out=out, qs=qs, ds=ds, n=n, groups=groups):
                        fn(grid, (launch.MMVQ_THREADS,), (wi.data, null, null, qs, ds, out, null, null,
                                                          np.int32(M), np.int32(0), np.int32(0), np.int32(K),
                                                          np.int64(wi.row_bytes), np.int32(groups)))
                    call(w0)
                    y = out.get()
                    if n not in ref:
                        ref[n] = y
                    err = float(np.abs(y - ref[n]).max() / np.abs(ref[n]).max())
                    us = time_batched(call, ws, args.reps)
                    results.append((tname, vname, n, groups, us, err))
        del ws, w0
        cp.get_default_memory_pool().free_all_blocks()

    for tname in args.types.split(","):
        info = TYPES[TYPE_NAMES[tname]]
        us, gbs = read_ceiling(M * K // info.block_size * info.type_size, args.reps)
        print(f"plain streaming read of the {tname} weights' size: {us:.1f} us, {gbs:.0f} GB/s")
    print(f"\nm = {M}, k = {K}; kernel us, best of groups 1/2/4 (the group count in brackets); medians of {args.reps}")
    for tname in args.types.split(","):
        nbytes = M * K // TYPES[TYPE_NAMES[tname]].block_size * TYPES[TYPE_NAMES[tname]].type_size
        print(f"\n{tname}: weights {nbytes / 1e6:.1f} MB")
        print("| variant | " + " | ".join(f"n={n}" for n in range(1, 9)) + " | n=1 GB/s | n=8 / n=1 | max rel err |")
        print("| --- " * 12 + "|")
        for vname, _ in VARIANTS:
            rs = [r for r in results if r[0] == tname and r[1] == vname]
            best = {n: min((r for r in rs if r[2] == n), key=lambda r: r[4]) for n in range(1, 9)}
            err = max(r[5] for r in rs)
            print(f"| {vname} | " + " | ".join(f"{best[n][4]:.1f} ({best[n][3]})" for n in range(1, 9)) +
                  f" | {nbytes / (best[1][4] * 1e-6) / 1e9:.0f} | {best[8][4] / best[1][4]:.2f} | {err:.1e} |")


if __name__ == "__main__":
    main()
