#!/usr/bin/env python3
"""Nsight Compute's view of the MMVQ kernels (kernels/mmvq.cu mmvq, mmvq_pieces, mmvq_mma_q4_K) on one random
matrix (ncu on the PATH; GPU machine).

    python scripts/ncu_mmvq.py [--type q4_K] [--m 4096] [--k 14336] [--ncols 1,8]

Launches each kernel twice per column count (the launch rules of launch.py) under
`ncu --clock-control none` with the SpeedOfLight, Occupancy, MemoryWorkloadAnalysis, LaunchStats and
ComputeWorkloadAnalysis sections, and prints the second launch's duration, clock, DRAM / L1 / L2 / SM throughput,
issue slots busy, achieved occupancy, L1 hit rate and registers per kernel and n.
"""
import argparse
import csv
import io
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

METRICS = ("Duration", "SM Frequency", "DRAM Throughput", "L1/TEX Cache Throughput", "L2 Cache Throughput",
           "Compute (SM) Throughput", "Issue Slots Busy", "Achieved Occupancy", "L1/TEX Hit Rate",
           "Registers Per Thread")


def run_kernels(args):
    import cupy as cp
    import numpy as np

    from bench_kernels import TYPE_NAMES
    from engine.cuda import launch
    from engine.cuda.build import kernel
    from engine.cuda.weights import upload
    from engine.quants import TYPES, random_blocks
    t = TYPE_NAMES[args.type]
    rng = np.random.default_rng()
    w = upload(t, (args.m, args.k), random_blocks(t, args.m * args.k // TYPES[t].block_size, rng))
    for n in (int(c) for c in args.ncols.split(",")):
        qs, ds = launch.quantize_q8_1(cp.asarray(rng.standard_normal((n, args.k)).astype(np.float32)))
        y = cp.empty((n, args.m), cp.float32)
        kinds = [(f"mmvq<{int(t)}, {n}, 0>", launch.mmvq_rows(n), launch._mmvq_groups(int(t), args.m, args.k),
                  launch.MMVQ_THREADS)]
        if int(t) in launch.PIECE_TYPES:
            kinds.append((f"mmvq_pieces<{int(t)}, {n}, 0>", launch.mmvqp_rows(n),
                          launch._mmvqp_groups(int(t), args.m, args.k), launch.MMVQ_THREADS))
        if int(t) in launch.MMA_TYPES:
            kinds.append((f"mmvq_mma_q4_K<{n}, 0>", 16, 1, 32 * launch.MMVQM_WARPS))
        for name, rows, groups, threads in kinds:
            fn = kernel("mmvq", name)
            grid = ((args.m + groups * rows - 1) // (groups * rows),)
            for _ in range(2):
                fn(grid, (threads,), launch.mmvq_args([w], qs, ds, [y], groups))
    cp.cuda.runtime.deviceSynchronize()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--type", default="q4_K")
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--k", type=int, default=14336)
    ap.add_argument("--ncols", default="1,8")
    ap.add_argument("--run", action="store_true", help="(internal) launch the kernels")
    args = ap.parse_args()
    if args.run:
        run_kernels(args)
        return
    cmd = ["ncu", "--clock-control", "none", "--csv", "--page", "details", "-k", "regex:mmvq",
           "--section", "SpeedOfLight", "--section", "Occupancy", "--section", "MemoryWorkloadAnalysis",
           "--section", "LaunchStats", "--section", "ComputeWorkloadAnalysis",
           sys.executable, __file__, "--run", "--type", args.type, "--m", str(args.m),
           "--k", str(args.k), "--ncols", args.ncols]
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ))
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith('"')]
    if not lines:
        print("ncu gave no rows:", r.stdout[-2000:], r.stderr[-2000:])
        sys.exit(1)
    by_id = defaultdict(dict)
    names = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        names[row["ID"]] = row["Kernel Name"]
        if row["Metric Name"] in METRICS:
            by_id[row["ID"]][row["Metric Name"]] = f'{row["Metric Value"]} {row["Metric Unit"]}'.strip()
    ids = sorted(by_id, key=int)
    print(f"{args.type} m = {args.m}, k = {args.k} (ncu, second launch of each)")
    print("| kernel | " + " | ".join(METRICS) + " |")
    print("| --- " * (len(METRICS) + 1) + "|")
    for i in ids[1::2]:
        print(f"| {names[i].split('(')[0]} | " + " | ".join(by_id[i].get(mt, "-") for mt in METRICS) + " |")


if __name__ == "__main__":
    main()
