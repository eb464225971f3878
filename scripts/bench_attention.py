#!/usr/bin/env python3
"""Prefill attention on the GPU at the real models' shapes: one sequence, a ubatch of n tokens from position 0.

    python scripts/bench_attention.py [--n 512] [--reps 20]

Times the attention kernel alone (10 back-to-back launches on a filled cache, / 10) with an f16 cache (tensor cores,
attention_mma.cu) and an f32 cache (SIMT, attention.cu), medians of reps with CUDA events; TFLOPS counts the causal
half of QK^T and PV (4 n^2/2 d flops per head).
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_kernels import time_batched  # noqa: E402

from engine.backends.base import Batch  # noqa: E402

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Gemma 3 270M": (4, 1, 256), "Llama-3 8B": (32, 8, 128)}  # n_head, n_kv, d


def main():
    import cupy as cp

    from engine.backends.cuda import CUDABackend
    from engine.cuda import launch
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    n, rng = args.n, np.random.default_rng()
    batch = Batch.make(np.zeros(n), np.arange(n), np.zeros(n), np.array([n - 1]))
    print(f"prefill attention, {n} tokens from position 0, medians of {args.reps}\n")
    print("| model shape | n_head / n_kv / head_dim | f16 cache (mma) us | TFLOPS | f32 cache (SIMT) us | TFLOPS |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (n_head, n_kv, d) in SHAPES.items():
        q = cp.asarray(rng.standard_normal((n, n_head, d)).astype(np.float32))
        k = cp.asarray(rng.standard_normal((n, n_kv, d)).astype(np.float32))
        v = cp.asarray(rng.standard_normal((n, n_kv, d)).astype(np.float32))
        cells = []
        for kv_f32 in (False, True):
            be = CUDABackend(kv_f32=kv_f32, graphs=False)
            cache = be.kv_cache(1, 1, n, n_kv, d)
            out = cp.empty((n, n_head, d), cp.float32)
            with be.stream:
                be.attention(q, k, v, cache, 0, batch, d ** -0.5, None)      # stores k, v in the cache
                args_ = (q, cache.k[0], cache.v[0], out, be._dev(batch.seq_ids), be._dev(batch.positions),
                         np.int32(n), np.int32(n_head), np.int32(n_kv), np.int32(n), np.float32(d ** -0.5),
                         np.int32(0))
                if kv_f32:
                    us = time_batched(lambda _: launch.attention_prefill_simt(d, ((n + 31) // 32, n_head), args_),
                                      [None], args.reps)
                else:
                    us = time_batched(lambda _: launch.attention_prefill_mma(d, ((n + 15) // 16, n_head), args_),
                                      [None], args.reps)
            flops = 4 * n * n / 2 * d * n_head
            cells += [f"{us:.1f}", f"{flops / (us * 1e-6) / 1e12:.1f}"]
        print(f"| {name} | {n_head} / {n_kv} / {d} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
