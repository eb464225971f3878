#!/usr/bin/env python3
"""Kernel benchmark at llama.cpp's test-backend-ops shapes: m = 4096, k = 14336, n in {1,2,3,4,5,8,512}.

    python scripts/bench_kernels.py [--reps 50] [--types q4_K,q8_0] [--ns 1,9,16] [--compare]

Two times per (type, n, path), medians over reps with CUDA events, weights rotated over copies that together exceed
the L2 cache:
  call_us   one whole mul_mat call from Python (activation quantization, allocations and launch costs included)
  kernel_us the GPU time of the matmul kernel(s) alone: 10 back-to-back launches on preallocated buffers, divided by 10
TOPS = 2*m*n*k / kernel_us; weight GB/s = weight bytes / kernel_us.
--compare also times every quantized type on each path that can take n above 8 columns (MMVQ up to 16, MMQ from 16,
dequantize+cuBLAS) at n = 9, 12, 16, ..., 512 (for dispatch.py's table). --ns replaces the column counts.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.quants import TYPES, GGMLType, random_blocks  # noqa: E402

M, K = 4096, 14336
TYPE_NAMES = {"f16": GGMLType.F16, "q4_0": GGMLType.Q4_0, "q4_1": GGMLType.Q4_1, "q5_0": GGMLType.Q5_0,
              "q8_0": GGMLType.Q8_0, "q4_K": GGMLType.Q4_K, "q5_K": GGMLType.Q5_K, "q6_K": GGMLType.Q6_K,
              "q2_K": GGMLType.Q2_K, "q3_K": GGMLType.Q3_K, "q5_1": GGMLType.Q5_1, "iq4_nl": GGMLType.IQ4_NL,
              "iq4_xs": GGMLType.IQ4_XS}
DEFAULT_TYPES = ["f16", "q4_0", "q4_1", "q5_0", "q8_0", "q4_K", "q5_K", "q6_K"]


def time_call(fn, reps):
    import cupy as cp
    for _ in range(3):
        fn(0)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for i in range(reps):
        start.record()
        fn(i)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1000.0)   # us
    return float(np.median(times))


def kernel_only(path, w, x, out):
    """A closure launching just the matmul kernel(s) of `path` on preallocated inputs and output."""
    import cupy as cp

    from engine.cuda import launch
    n = x.shape[0]
    if path == "mmvq":                      # the launch's arguments built once per weight copy (no Python per call)
        qs, ds = launch.quantize_q8_1(x)
        plans = {}

        def run(wi):
            if id(wi) not in plans:
                plans[id(wi)] = launch.mmvq_launches([wi], qs, ds, n, [out])
            for fn, grid, block, args in plans[id(wi)]:
                fn(grid, block, args)
        return run
    if path == "mmq":
        qs, ds = launch.quantize_q8_1(x, (n + launch.MMQ_BN - 1) // launch.MMQ_BN * launch.MMQ_BN)
        return lambda wi: launch.mmq(wi, qs, ds, n, out)
    if path == "dequant":
        deq = cp.empty((w.m, w.k), cp.float16)
        x16 = x.astype(cp.float16)
        return lambda wi: (launch.dequantize_into(wi, deq), launch.gemm_xwt(x16, deq, out))
    if path == "mmvf":
        return lambda wi: launch.mmvf(wi, x, out)
    return lambda wi: launch.gemm_xwt(x, wi.data, out)


def time_batched(fn, ws, reps, batch=10):
    return time_call(lambda i: [fn(ws[(i * batch + b) % len(ws)]) for b in range(batch)], reps) / batch


def time_graph(call, ws, reps: int, per: int = 20) -> float:
    """us per call: call(w) for `per` weights in turn captured as one CUDA graph, median of reps replays / per."""
    import cupy as cp
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        call(ws[0])                                   # loads the kernel outside the capture
        stream.synchronize()
        stream.begin_capture()
        for i in range(per):
            call(ws[i % len(ws)])
        graph = stream.end_capture()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for i in range(reps + 3):
        start.record(stream)
        graph.launch(stream=stream)
        stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1000.0 / per)
    return float(np.median(times[3:]))


def warm_gpu(seconds: float = 1.0):
    """Keep the GPU busy copying for a while so its clocks are up before timing (an idle H200 sat at 345 MHz, and a
    variants run started right after measured every kernel ~20 % slow)."""
    import time

    import cupy as cp
    a = cp.empty(256 << 20, cp.uint8)
    b = cp.empty_like(a)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            cp.copyto(b, a)
        cp.cuda.Device().synchronize()


def copy_bandwidth():
    import cupy as cp
    a = cp.empty(2 << 30, cp.uint8)
    b = cp.empty_like(a)
    us = time_call(lambda i: cp.copyto(b, a), 10)
    return 2 * a.nbytes / (us * 1e-6) / 1e9


def main():
    import cupy as cp

    from engine.cuda import launch
    from engine.cuda.dispatch import choose_path, mul_mat
    from engine.cuda.weights import upload

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--types", default=",".join(DEFAULT_TYPES))
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--ns", default="", help="column counts (default: the issue's)")
    ap.add_argument("--graph", action="store_true",
                    help="MMVQ kernel times from a CUDA graph of 20 launches (no host time between launches, which "
                         "10 back-to-back launches from Python leave where a kernel is shorter than its launch)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"copy bandwidth {copy_bandwidth():.0f} GB/s (read + write)")
    rows = []
    for name in args.types.split(","):
        t = TYPE_NAMES[name]
        info = TYPES[t]
        blocks = random_blocks(t, M * K // info.block_size, rng)
        w0 = upload(t, (M, K), blocks)
        copies = max(2, int(np.ceil(200e6 / w0.nbytes)))          # > 2x the 50 MB L2
        ws = [w0] + [upload(t, (M, K), blocks) for _ in range(copies - 1)]
        ns = [1, 2, 3, 4, 5, 8, 512] + ([16, 32, 64, 128, 256] if t == GGMLType.Q4_K else [])
        if args.compare and info.quantized:
            ns = sorted(set(ns) | {9, 12, 16, 32, 64, 128, 256, 512})
        if args.ns:
            ns = [int(v) for v in args.ns.split(",")]
        for n in sorted(ns):
            x = cp.asarray(rng.standard_normal((n, K)).astype(np.float32))
            paths = [choose_path(w0, n)]
            if args.compare and info.quantized and n > 8:
                paths = (["mmvq"] if n <= launch.mmvq_max_cols(int(t)) else []) + (["mmq"] if n >= 16 else []) + ["dequant"]
            out = cp.empty((n, M), cp.float32)
            for path in paths:
                call_us = time_call(lambda i: mul_mat(ws[i % len(ws)], x, path=path), args.reps)
                timer = time_graph if args.graph and path == "mmvq" else time_batched
                us = timer(kernel_only(path, w0, x, out), ws, args.reps)
                rows.append((name, n, path, call_us, us, w0.nbytes / (us * 1e-6) / 1e9,
                             2 * M * n * K / (us * 1e-6) / 1e12))
        del ws, w0
        cp.get_default_memory_pool().free_all_blocks()
    print(f"\nm = {M}, k = {K}; medians of {args.reps}\n")
    print("| type | n | path | call us | kernel us | weight GB/s | TOPS |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, n, path, call_us, us, gbs, tops in rows:
        print(f"| {name} | {n} | {path} | {call_us:.1f} | {us:.1f} | {gbs:.0f} | {tops:.1f} |")


if __name__ == "__main__":
    main()
