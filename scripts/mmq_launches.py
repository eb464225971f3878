#!/usr/bin/env python3
"""Two MMQ calls (launch.mmq, split-k as dispatched) per type and column count on random m x k weights: something for
a profiler to look at (GPU machine).

    ncu --clock-control none -k regex:mmq --section SpeedOfLight --section WarpStateStats --section InstructionStats \
        --section Occupancy --section ComputeWorkloadAnalysis python3 scripts/mmq_launches.py [--types q4_K,q6_K] [--ns 64,512]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
from bench_kernels import TYPE_NAMES  # noqa: E402

from engine.cuda import launch  # noqa: E402
from engine.cuda.weights import upload  # noqa: E402
from engine.quants import TYPES, random_blocks  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--types", default="q4_K,q6_K")
ap.add_argument("--ns", default="64,512")
ap.add_argument("--m", type=int, default=4096)
ap.add_argument("--k", type=int, default=14336)
args = ap.parse_args()
rng = np.random.default_rng()
for name in args.types.split(","):
    t = TYPE_NAMES[name]
    w = upload(t, (args.m, args.k), random_blocks(t, args.m * args.k // TYPES[t].block_size, rng))
    for n in map(int, args.ns.split(",")):
        x = cp.asarray(rng.standard_normal((n, args.k)).astype(np.float32))
        qs, ds = launch.quantize_q8_1(x, launch.mmq_n_pad(n))
        for _ in range(2):
            launch.mmq(w, qs, ds, n)
cp.cuda.runtime.deviceSynchronize()
