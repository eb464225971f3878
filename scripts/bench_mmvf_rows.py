#!/usr/bin/env python3
"""Time MMVF (kernels/mmvf.cu) built with other rows per block (MMVF_ROWS_1 / _N / _HI, all set alike) at
m = 4096, k = 14336,
n = 1..8, f16 and f32 weights, to choose the defaults.

    python scripts/bench_mmvf_rows.py [--rows 1,2,4,8] [--reps 20]

Each build's outputs are checked against numpy (nmse); kernel time: 10 back-to-back launches on preallocated buffers
/ 10, weights rotated over copies that together exceed the L2; medians of reps.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels import K, M, time_batched  # noqa: E402


def main():
    import cupy as cp

    from engine.cuda.build import NVRTC_OPTIONS, expanded_source
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng()
    print(f"m = {M}, k = {K}; kernel us (weight GB/s), medians of {args.reps}")
    print("| weights | rows per block | " + " | ".join(f"n={n}" for n in range(1, 9)) + " | max nmse |")
    print("| --- " * 11 + "|")
    for dt, wname, vec in ((np.float16, "u16", 8), (np.float32, "float", 4)):
        wf = rng.standard_normal((M, K)).astype(dt)
        ws = [cp.asarray(wf) for _ in range(max(2, int(np.ceil(200e6 / wf.nbytes))))]
        xs = {n: rng.standard_normal((n, K)).astype(np.float32) for n in range(1, 9)}
        refs = {n: xs[n].astype(np.float64) @ wf.astype(np.float64).T for n in range(1, 9)}
        for rows in map(int, args.rows.split(",")):
            names = [f"mmvf<{wname}, {n}, {vec}>" for n in range(1, 9)]
            mod = cp.RawModule(code=expanded_source("mmvf"), options=NVRTC_OPTIONS + (
                f"-DMMVF_ROWS_1={rows}", f"-DMMVF_ROWS_N={rows}", f"-DMMVF_ROWS_HI={rows}"), name_expressions=names)
            cells, worst = [], 0.0
            for n in range(1, 9):
                fn, x = mod.get_function(names[n - 1]), cp.asarray(xs[n])
                out = cp.empty((n, M), cp.float32)

                def call(w, fn=fn, x=x, out=out):
                    fn(((M + rows - 1) // rows,), (128,), (w, x, out, np.int32(M), np.int32(K)))
                call(ws[0])
                y = out.get()
                worst = max(worst, float(np.sum((y - refs[n]) ** 2) / np.sum(refs[n] ** 2)))
                us = time_batched(call, ws, args.reps)
                cells.append(f"{us:.1f} ({wf.nbytes / (us * 1e-6) / 1e9:.0f})")
            print(f"| {dt.__name__} | {rows} | " + " | ".join(cells) + f" | {worst:.1e} |", flush=True)
        del ws
        cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
