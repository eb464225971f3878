#!/usr/bin/env python3
"""Time mmq_q4_K (kernels/mmq.cu) built with other tuning knobs (MMQK_SCALE_TABLE, MMQK_FMA_RESCALE, MMQK_CC_UNROLL)
at m = 4096, k = 14336, n = 16..512 (split-k as launch.mmq_splits sets it), to choose the defaults.

    python scripts/bench_mmq_variants.py [--ns 16,64,128,512] [--reps 20]

Each variant's output is checked against the first one's (the same sums, rounded in another order: nmse < 1e-10).
Kernel time: 10 back-to-back calls / 10, weights rotated over 4 copies (more than the L2); medians of reps.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kernels import K, M, time_batched, warm_gpu  # noqa: E402

from engine.cuda import launch  # noqa: E402
from engine.cuda.build import NVRTC_OPTIONS, expanded_source  # noqa: E402
from engine.cuda.weights import upload  # noqa: E402
from engine.quants import TYPES, GGMLType, random_blocks  # noqa: E402

VARIANTS = [("table, fma, cc x2 (defaults)", {}),
            ("no table, one expression, cc x1 (before)", dict(MMQK_SCALE_TABLE=0, MMQK_FMA_RESCALE=0, MMQK_CC_UNROLL=1)),
            ("no table, fma, cc x1", dict(MMQK_SCALE_TABLE=0, MMQK_CC_UNROLL=1)),
            ("table, one expression, cc x1", dict(MMQK_FMA_RESCALE=0, MMQK_CC_UNROLL=1)),
            ("table, fma, cc x1", dict(MMQK_CC_UNROLL=1))]


def build(defines: dict):
    opts = NVRTC_OPTIONS + ("-DMMQ_SKIP_GENERIC",) + tuple(f"-D{k}={v}" for k, v in defines.items())
    mod = cp.RawModule(code=expanded_source("mmq"), options=opts, name_expressions=["mmq_q4_K", "mmq_split_sum"])
    return mod.get_function("mmq_q4_K"), mod.get_function("mmq_split_sum")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ns", default="16,64,128,512")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng()
    t = GGMLType.Q4_K
    blocks = random_blocks(t, M * K // TYPES[t].block_size, rng)
    ws = [upload(t, (M, K), blocks) for _ in range(4)]
    ns = [int(v) for v in args.ns.split(",")]
    acts = {n: launch.quantize_q8_1(cp.asarray(rng.standard_normal((n, K)).astype(np.float32)), launch.mmq_n_pad(n))
            for n in ns}
    fns = [(name, build(d)) for name, d in VARIANTS]
    _, smem, per_sm = launch.mmq_kernel(int(t))
    warm_gpu()
    ref, rows = {}, []
    for name, (fn, ssum) in fns:
        row = [name]
        for n in ns:
            qs, ds = acts[n]
            y = cp.empty((n, M), cp.float32)

            def call(w, qs=qs, ds=ds, n=n, y=y, fn=fn, ssum=ssum):
                launch.mmq_launch(fn, ssum, smem, per_sm, w, qs, ds, n, y)
            call(ws[0])
            out = y.get()
            ref.setdefault(n, out)
            err = float(np.mean((out - ref[n]) ** 2) / np.mean(ref[n] ** 2))
            assert err < 1e-10, (name, n, err)
            us = time_batched(call, ws, args.reps)
            row.append(f"{us:.1f}")
        rows.append(row)
    print(f"mmq_q4_K, m = {M}, k = {K}; kernel us (split-k as dispatched), medians of {args.reps}")
    print("| variant | " + " | ".join(f"n={n}" for n in ns) + " |")
    print("| --- " * (len(ns) + 1) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
