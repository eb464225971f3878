#!/usr/bin/env python3
"""MMQ kernel time with and without split-k (ENGINE_MMQ_SPLITS=1 against launch.mmq_splits' rule) at m = 4096,
k = 14336, n = 16..512, q4_K (generic mmq<12> and mmq_q4_K) and q8_0 (kernel us: 10 back-to-back calls / 10,
weights rotated over 4 copies).

    python scripts/bench_mmq_splits.py
"""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kernels import TYPE_NAMES, K, M, time_batched, warm_gpu  # noqa: E402

from engine.cuda import launch  # noqa: E402
from engine.cuda.weights import upload  # noqa: E402
from engine.quants import TYPES, random_blocks  # noqa: E402

warm_gpu()
rng = np.random.default_rng()
print("| type | n | kernel | splits | MMQ us unsplit | MMQ us split-k |")
for tname in ("q4_K", "q8_0"):
    t = TYPE_NAMES[tname]
    blocks = random_blocks(t, M * K // TYPES[t].block_size, rng)
    ws = [upload(t, (M, K), blocks) for _ in range(4)]
    for n in (16, 32, 64, 128, 256, 512):
        x = cp.asarray(rng.standard_normal((n, K)).astype(np.float32))
        qs, ds = launch.quantize_q8_1(x, launch.mmq_n_pad(n))
        out = cp.empty((n, M), cp.float32)
        for q4k in ("0", "1") if t == TYPE_NAMES["q4_K"] else ("0",):
            os.environ["ENGINE_MMQ_Q4K"] = q4k
            name, _, per_sm = launch.mmq_kernel(int(t))
            res = []
            for s in ("1", ""):
                if s:
                    os.environ["ENGINE_MMQ_SPLITS"] = s
                else:
                    os.environ.pop("ENGINE_MMQ_SPLITS", None)
                res.append(time_batched(lambda w: launch.mmq(w, qs, ds, n, out), ws, 10))
            splits = launch.mmq_splits(M, qs.shape[0], K, launch._sm_count() * per_sm)[0]
            print(f"| {tname} | {n} | {name} | {splits} | {res[0]:.1f} | {res[1]:.1f} |", flush=True)
