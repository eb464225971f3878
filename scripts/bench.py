#!/usr/bin/env python3
"""The benchmarks, one entry point:

    python scripts/bench.py mul-mat   [--reps 50] [--types q4_K,q8_0] [--ns 1,9,16] [--compare] [--graph]
                                      [--paths dequantize,gemm] [--shapes 4096x14336,128256x4096]
    python scripts/bench.py attention [--n 512] [--reps 20] [--decode 4096,16384 --rows 1,32]
    python scripts/bench.py norm      [--d 576,640,2560,4096,8192] [--rows 1,32,512]
    python scripts/bench.py decode    MODEL [--npl 1,8,16,32] [--npp 128] [--ntg 128] [--scheduler | --churn]
    python scripts/bench.py http      MODEL [--clients 1,8,32,64] [--step-ms 10] [--slots 64] [--shared-prefix N]
    python scripts/bench.py prefix-match [--followers 10,100,500,1000] [--prefix 2003]
    python scripts/bench.py burst     MODEL [--clients 32] [--prefix 2000] [--max-batch-tokens 512] [--rounds 4]
                                      [--host-only]

(`engine bench MODEL` measures one sequence's prefill and decode, llama-bench's pp / tg; scripts/load_test.py a
running server.) Each subcommand's own description follows.

mul-mat: Kernel benchmark at llama.cpp's test-backend-ops shapes: m = 4096, k = 14336, n in {1,2,3,4,5,8,512}.

    python scripts/bench.py mul-mat [--reps 50] [--types q4_K,q8_0] [--ns 1,9,16] [--compare] [--graph]
                                    [--paths dequantize,gemm] [--shapes 4096x14336,128256x4096]

Two times per (type, n, path), medians over reps with CUDA events, weights rotated over copies that together exceed
the L2 cache:
  call_us   one whole mul_mat call from Python (activation quantization, allocations and launch costs included)
  kernel_us the GPU time of the matmul kernel(s) alone: 10 back-to-back launches on preallocated buffers, divided by
            10; with --graph 20 calls captured as one CUDA graph, divided by 20 (no host time between launches: the
            figure for kernels shorter than a launch from Python, ~5 us, and for decode steps, which replay graphs)
TOPS = 2*m*n*k / kernel_us; weight GB/s = weight bytes / kernel_us.
--compare times every quantized type on each path that can take n (MMVQ up to its column limit, MMQ from 16,
mmq_f16, dequantize+cuBLAS from 16) at n = 1, ..., 512 (for dispatch.py's tables). --ns replaces the column counts.
--paths replaces the paths: also `dequantize` and `gemm`, the two halves of dequantize+cuBLAS alone (no call_us).
--shapes replaces m x k (e.g. a model's output matrix, 128256x4096).

attention: Prefill attention on the GPU at the real models' shapes: one sequence, a ubatch of n tokens from position 0.

    python scripts/bench.py attention [--n 512] [--reps 20]

Times the attention kernel alone (10 back-to-back launches on a filled cache, / 10) with an f16 cache (tensor cores,
attention_mma.cu) and an f32 cache (SIMT, attention.cu), medians of reps with CUDA events; TFLOPS counts the causal
half of QK^T and PV (4 n^2/2 d flops per head).
--decode DEPTHS times decode attention instead (attention_decode, through the backend: the rows' k, v stored too):
--rows sequences of one query each at position DEPTH of a paged f16 cache (blocks of 16), 20 calls captured as one
CUDA graph (no launch gaps), each on another layer of a cache larger than the L2; KV GB/s counts the keys and values
read.

norm: The residual add and RMS norm of every layer (add_rms_norm, the q8_1 blocks of its output written too at up
to 8 rows) at row lengths --d and --rows rows: 20 calls captured as one CUDA graph, medians of --reps.

    python scripts/bench.py norm [--d 576,640,2560,4096,8192] [--rows 1,32,512] [--reps 20] [--post-norm]
                                 [--threads 256,512,1024]

GB/s counts x, r read and s, y written (f32).

decode: Batched decode speed, llama-batched-bench style: B sequences each prefilled with npp random tokens, then ntg decode
steps of all B at once (greedy, the argmax taken on the device); generated tokens/s = B * ntg / time of the steps.
--reps N: N such runs per B (with --scheduler too), their mean ± standard deviation (llama-bench -r N's form).

    python scripts/bench.py decode MODEL [--npl 1,8,16,32] [--npp 128] [--ntg 128] [--device cuda] [--reps 3]
    python scripts/bench.py decode MODEL --scheduler [--temp 0.8]
    python scripts/bench.py decode MODEL --churn [--npp 12 --ntg 64 --seconds 8]

--scheduler measures the engine core as `engine serve` runs it, without HTTP: B requests submitted to the Scheduler
at once (prefilled together), then decoded with sampling on the device; tokens/s from the step where all B are
decoding to the last.

--churn measures the engine core under a server's load, without HTTP: B requests in flight at all times, each
replaced by a new one (a fresh npp-token prompt) as it finishes, their ends spread out as a server's clients'; so most
steps carry a prompt or two beside the decode rows. Prints tokens/s, TTFT (submit to first token) and the steps.

ANCHORS.md's llama.cpp figures: `llama-batched-bench -npp 128 -ntg 128 -npl B -fa on`.

http: What the HTTP front end costs: `engine serve`'s app in front of a stand-in engine core that emits one token per
running request every --step-ms (as a GPU step would), loaded by scripts/load_test.py.

    python scripts/bench.py http MODEL.gguf --clients 1,8,32,64 --step-ms 10 --slots 64 [--seconds 8]

The stand-in runs no model: the figure is the front end's (tokenization, detokenization, stop strings, SSE,
uvicorn) and the load generator's ceiling on this machine. A core that steps every S ms with B requests running
emits B / S tokens per ms; each row prints that ceiling beside what the clients received.
MODEL only supplies the tokenizer.

prefix-match: The block manager's lookup of a new prompt's cached prefix (BlockManager.match, once per admission)
when a shared --prefix of tokens has been followed by --followers requests, each leaving its own block after it
(what load_test.py --shared-prefix builds up in a server): ms per lookup, mean of 20.

burst: The shared-prefix burst through the engine core alone (the Scheduler as engine serve runs it, warmed up the
same way, no HTTP): per round one request of a --prefix-token shared text and a 20-token question, then --clients
such requests at once. Prints their TTFT (submit to first token) and each step's rows, logit rows and sequences, the
forward's time and the whole step's (admission, block copies and sampling included). --host-only: from the second
round on, the forward returns zero logits without running the model, so that the step's time is the engine core's
host work alone (admission, prefix matching, block copies, sampling, events). --profile-steps N: every step under
cProfile; at the end, the N steps with the most time outside their forward, their functions by own time.

    python scripts/bench.py burst MODEL [--clients 32] [--prefix 2000] [--max-batch-tokens 512] [--rounds 4]
                                        [--host-only] [--profile-steps 2]
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from pathlib import Path
import argparse
import cProfile
import dataclasses
import multiprocessing
import os
import pstats
import subprocess
import sys
import time

import httpx
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.backends.base import Batch
from engine.bench import _sync
from engine.cuda.config import CudaConfig
from engine.model.base import KV_TYPE_BYTES
from engine.quants import TYPES, GGMLType, random_blocks
from engine.runtime import Runtime
from server.core import CoreConfig
from server.messages import (Abort, AddRequest, CoreStats, Event, Outputs, Ready, Shutdown, encoder,
                             to_core_decoder)  # noqa: E402


# ---- mul-mat -------------------------------------------------------------------------------------------------------

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

    from engine.cuda import mmvq as mmvq_launch

    from engine.cuda import mmq as mmq_launch
    n = x.shape[0]
    if path == "mmvq":                      # the launch's arguments built once per weight copy (no Python per call)
        residual = mmvq_launch.takes_residual(int(w.type), n)
        qs, ds, *rs = launch.quantize_q8_1(x, residual=residual)
        plans = {}

        def run(wi):
            if id(wi) not in plans:
                plans[id(wi)] = mmvq_launch.mmvq_launches([wi], qs, ds, n, [out], rs=rs[0] if rs else None)
            for fn, grid, block, args in plans[id(wi)]:
                fn(grid, block, args)
        return run
    if path == "mmq":
        qs, ds = launch.quantize_q8_1(x, (n + mmq_launch.MMQ_BN - 1) // mmq_launch.MMQ_BN * mmq_launch.MMQ_BN)
        return lambda wi: mmq_launch.mmq(wi, qs, ds, n, out)
    if path == "mmq_f16":
        from engine.cuda.mmq_f16 import mmq_f16
        x16 = x.astype(cp.float16)
        return lambda wi: mmq_f16(wi, x16, out)
    if path in ("dequant", "dequantize", "gemm"):    # dequantize + cuBLAS, and each of its two halves alone
        deq = cp.empty((w.m, w.k), cp.float16)
        x16 = x.astype(cp.float16)
        if path == "dequantize":
            return lambda wi: launch.dequantize_into(wi, deq)
        if path == "gemm":
            return lambda wi: launch.gemm_xwt(x16, deq, out)
        return lambda wi: (launch.dequantize_into(wi, deq), launch.gemm_xwt(x16, deq, out))
    if path == "mmvf":
        return lambda wi: launch.mmvf(wi.data, x, out)
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


def mul_mat_main(argv):
    import cupy as cp


    from engine.cuda import mmvq as mmvq_launch

    from engine.cuda.config import CudaConfig, configure
    from engine.cuda.dispatch import choose_path, mul_mat
    from engine.cuda.weights import upload

    ap = argparse.ArgumentParser(prog="bench.py mul-mat")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--types", default=",".join(DEFAULT_TYPES))
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--ns", default="", help="column counts (default: the issue's)")
    ap.add_argument("--paths", default="", help="these paths instead (mmvq, mmq, mmq_f16, dequant, and dequant's "
                                                 "halves alone: dequantize, gemm)")
    ap.add_argument("--decode-activations", default="q8_1", choices=("q8_1", "q16"),
                    help="one-column MMVQ on q8_1 activations (the default) or 16-bit ones")
    ap.add_argument("--graph", action="store_true",
                    help="kernel times from a CUDA graph of 20 calls (no host time between launches, which 10 "
                         "back-to-back calls from Python leave where a kernel is shorter than its launch)")
    ap.add_argument("--shapes", default=f"{M}x{K}", help="m x k of the weights, comma-separated (default: %(default)s)")
    args = ap.parse_args(argv)
    configure(CudaConfig(exact_decode=args.decode_activations == "q16"))
    rng = np.random.default_rng(0)
    print(f"device: {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, "
          f"copy bandwidth {copy_bandwidth():.0f} GB/s (read + write)")
    rows = []
    for (m, k), name in ((tuple(int(v) for v in s.split("x")), name) for s in args.shapes.split(",")
                         for name in args.types.split(",")):
        t = TYPE_NAMES[name]
        info = TYPES[t]
        blocks = random_blocks(t, m * k // info.block_size, rng)
        w0 = upload(t, (m, k), blocks)
        copies = max(2, int(np.ceil(200e6 / w0.nbytes)))          # > 2x the 50 MB L2
        ws = [w0] + [upload(t, (m, k), blocks) for _ in range(copies - 1)]
        ns = [1, 2, 3, 4, 5, 8, 512] + ([16, 32, 64, 128, 256] if t == GGMLType.Q4_K else [])
        if args.compare and info.quantized:
            ns = sorted(set(ns) | {9, 12, 16, 32, 64, 128, 256, 512})
        if args.ns:
            ns = [int(v) for v in args.ns.split(",")]
        for n in sorted(ns):
            x = cp.asarray(rng.standard_normal((n, k)).astype(np.float32))
            paths = [choose_path(w0, n)]
            if args.compare and info.quantized:
                paths = (["mmvq"] if n <= mmvq_launch.mmvq_max_cols(int(t)) else []) + (
                    ["mmq"] if n >= 16 else []) + ["mmq_f16"] + (["dequant"] if n >= 16 else [])
            if args.paths:
                paths = args.paths.split(",")
            out = cp.empty((n, m), cp.float32)
            for path in paths:
                if path == "mmvq" and n > mmvq_launch.mmvq_max_cols(int(t)):
                    continue                              # more columns than MMVQ takes for this type
                call_us = time_call(lambda i: mul_mat(ws[i % len(ws)], x, path=path), args.reps) \
                    if path not in ("dequantize", "gemm") else float("nan")
                us = (time_graph if args.graph else time_batched)(kernel_only(path, w0, x, out), ws, args.reps)
                rows.append((f"{m}x{k}", name, n, path, call_us, us, w0.nbytes / (us * 1e-6) / 1e9,
                             2 * m * n * k / (us * 1e-6) / 1e12))
        del ws, w0
        cp.get_default_memory_pool().free_all_blocks()
    print(f"\nmedians of {args.reps}\n")
    print("| m x k | type | n | path | call us | kernel us | weight GB/s | TOPS |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape, name, n, path, call_us, us, gbs, tops in rows:
        print(f"| {shape} | {name} | {n} | {path} | {call_us:.1f} | {us:.1f} | {gbs:.0f} | {tops:.1f} |")


# ---- attention -----------------------------------------------------------------------------------------------------

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Gemma 3 270M": (4, 1, 256), "Llama-3 8B": (32, 8, 128)}  # n_head, n_kv, d


def attention_main(argv):
    import cupy as cp

    from engine.backends.cuda import CUDABackend
    from engine.cuda import launch
    ap = argparse.ArgumentParser(prog="bench.py attention")
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--decode", default="", help="decode attention at these depths instead (4096,16384)")
    ap.add_argument("--rows", default="1,32", help="--decode's sequences")
    args = ap.parse_args(argv)
    if args.decode:
        return decode_attention([int(v) for v in args.decode.split(",")], [int(v) for v in args.rows.split(",")],
                                args.reps)
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
            be = CUDABackend(kv_f32=kv_f32, config=CudaConfig(graphs=False))
            cache = be.kv_cache(1, 1, n, n_kv, d)
            out = cp.empty((n, n_head, d), cp.float32)
            with be.stream:
                be.attention(q, k, v, cache, 0, batch, d ** -0.5, None)      # stores k, v in the cache
                tabs, paging = be._paging(batch, cache)
                args_ = (q, cache.k[0], cache.v[0], out, tabs, be._dev(batch.positions), *paging, np.uint64(0),
                         np.int32(n), np.int32(n_head), np.int32(n_kv), np.float32(d ** -0.5), np.int32(0),
                         np.float32(0))
                if kv_f32:
                    us = time_batched(lambda _: launch.attention_prefill_simt("float", d, ((n + 31) // 32, n_head),
                                                                              args_), [None], args.reps)
                else:
                    us = time_batched(lambda _: launch.attention_prefill_mma(d, ((n + 15) // 16, n_head), args_),
                                      [None], args.reps)
            flops = 4 * n * n / 2 * d * n_head
            cells += [f"{us:.1f}", f"{flops / (us * 1e-6) / 1e12:.1f}"]
        print(f"| {name} | {n_head} / {n_kv} / {d} | " + " | ".join(cells) + " |")


def decode_attention(depths: list[int], rows: list[int], reps: int) -> None:
    """Decode attention's time at the real models' shapes: `rows` queries at position depth, paged f16 cache."""
    import cupy as cp

    from engine.backends.cuda import CUDABackend
    print(f"decode attention through the backend (k, v stored), paged f16 cache: 20 calls as one CUDA graph, layers "
          f"rotated past the L2 cache; medians of {reps}\n")
    print("| model shape | depth | rows | us | KV GB/s |\n| --- | --- | --- | --- | --- |")
    rng = np.random.default_rng()
    for name, (n_head, n_kv, d) in SHAPES.items():
        for depth in depths:
            for b in rows:
                be = CUDABackend(config=CudaConfig(graphs=False))
                per = -(-(depth + 1) // 16)
                kv_bytes = 2 * b * (depth + 1) * n_kv * d * 2
                layers = max(2, min(20, -(-200_000_000 // kv_bytes)))        # > 2x the 50 MB L2 in all
                cache = be.kv_cache(layers, b * per, 16, n_kv, d)
                for c in (*cache.k, *cache.v):
                    c[:] = cp.random.standard_normal(c.shape, dtype=cp.float32).astype(cp.float16)
                batch = Batch.make(np.zeros(b), [depth] * b, np.arange(b), np.arange(b),
                                   {s: list(range(s * per, (s + 1) * per)) for s in range(b)})
                q = cp.asarray(rng.standard_normal((b, n_head, d)).astype(np.float32))
                k, v = (cp.asarray(rng.standard_normal((b, n_kv, d)).astype(np.float32)) for _ in range(2))
                with be.stream:
                    us = time_graph(lambda layer: be.attention(q, k, v, cache, layer, batch, d ** -0.5, None),
                                    list(range(layers)), reps)
                print(f"| {name} | {depth} | {b} | {us:.1f} | {kv_bytes / (us * 1e-6) / 1e9:.0f} |", flush=True)
                del cache
                cp.get_default_memory_pool().free_all_blocks()


def norm_main(argv):
    import cupy as cp

    from engine.backends import cuda as cuda_backend
    from engine.backends.cuda import CUDABackend
    from engine.cuda import build
    ap = argparse.ArgumentParser(prog="bench.py norm")
    ap.add_argument("--d", default="576,640,2560,4096,8192")
    ap.add_argument("--rows", default="1,32,512")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--post-norm", action="store_true", help="Gemma 3's form: r RMS-normed first")
    ap.add_argument("--threads", default="", help="threads a block instead of norm_threads' rule (256,512,1024: a "
                    "sweep; rows whose values a thread would then exceed build.NORM_VALUES are skipped)")
    args = ap.parse_args(argv)
    be = CUDABackend(config=CudaConfig(graphs=False))
    rng = np.random.default_rng()
    rule = cuda_backend.norm_threads
    print(f"add_rms_norm{' with a post-norm' if args.post_norm else ''}: 20 calls as one CUDA graph, medians of "
          f"{args.reps}\n\n| d | rows | threads | us | GB/s |\n| --- | --- | --- | --- | --- |")
    for d in (int(v) for v in args.d.split(",")):
        w, wr = (cp.asarray(rng.standard_normal(d).astype(np.float32)) for _ in range(2))
        for n in (int(v) for v in args.rows.split(",")):
            x, r = (cp.asarray(rng.standard_normal((n, d)).astype(np.float32)) for _ in range(2))
            for threads in [int(v) for v in args.threads.split(",")] if args.threads else [rule(d)]:
                if -(-d // threads) > build.NORM_VALUES[-1]:
                    continue
                cuda_backend.norm_threads = lambda _d, t=threads: t
                try:
                    with be.stream:
                        us = time_graph(lambda _: be.add_rms_norm(x, r, w, 1e-6,
                                                                  r_norm=wr if args.post_norm else None),
                                        [None], args.reps)
                finally:
                    cuda_backend.norm_threads = rule
                print(f"| {d} | {n} | {threads} | {us:.2f} | {4 * n * d * 4 / (us * 1e-6) / 1e9:.0f} |", flush=True)


# ---- decode --------------------------------------------------------------------------------------------------------

def decode_speed(rt: Runtime, b: int, npp: int, ntg: int, rng) -> float:
    for s in range(b):
        rt.prefill(rng.integers(100, rt.config.n_vocab - 100, npp).tolist(), seq=s, logits=False)
    toks = rng.integers(100, rt.config.n_vocab - 100, b).tolist()
    seqs = list(range(b))
    rt.decode(seqs, toks, [npp] * b, greedy=True)                 # loads kernels, captures this batch size's graph
    _sync(rt)
    t0 = time.perf_counter()
    for i in range(1, ntg + 1):
        toks = [int(t) for t in rt.decode(seqs, toks, [npp + i] * b, greedy=True)]
    _sync(rt)
    return b * ntg / (time.perf_counter() - t0)


def scheduler_speed(rt: Runtime, b: int, npp: int, ntg: int, rng, temperature: float) -> float:
    """Tokens/s of the Scheduler's steps once all b requests are decoding (their prompts are prefilled together
    first, in chunks of the step budget, as a server admits them)."""
    from engine.sampling import SamplingParams
    from engine.scheduler import Request, Scheduler, TokenEvent
    sched = Scheduler(rt)
    counts = [0] * b

    def on_event(i):
        def count(ev):
            counts[i] += isinstance(ev, TokenEvent)
        return count
    for i in range(b):
        prompt = rng.integers(100, rt.config.n_vocab - 100, npp).tolist()
        params = SamplingParams(temperature=temperature, top_k=0, top_p=1.0, min_p=0.0)
        sched.submit(Request(prompt, params, ntg, ignore_eos=True), on_event(i))
    while min(counts) == 0:
        sched.step()
    _sync(rt)
    t0, before = time.perf_counter(), sum(counts)
    while sched.step():
        pass
    _sync(rt)
    return (sum(counts) - before) / (time.perf_counter() - t0)


def churn_speed(rt: Runtime, b: int, npp: int, ntg: int, seconds: float, rng, temperature: float) -> str:
    """B requests kept in flight for `seconds` (after one warm-up round) -> a table row."""
    from engine.sampling import SamplingParams
    from engine.scheduler import Request, Scheduler, TokenEvent
    sched = Scheduler(rt)
    tokens, ttft, submitted = [0], [], {}

    def submit(max_tokens: int) -> None:
        prompt = rng.integers(100, rt.config.n_vocab - 100, npp).tolist()
        params = SamplingParams(temperature=temperature, top_k=40, top_p=0.95, min_p=0.0,
                                seed=int(rng.integers(1 << 31)))
        box = {}

        def on_event(ev):
            if isinstance(ev, TokenEvent):
                tokens[0] += 1
                if box["sid"] in submitted:
                    ttft.append(time.perf_counter() - submitted.pop(box["sid"]))
            elif measuring[0]:
                submit(ntg)
        box["sid"] = sched.submit(Request(prompt, params, max_tokens, ignore_eos=True), on_event)
        submitted[box["sid"]] = time.perf_counter()
    measuring = [True]
    for i in range(b):                                   # the first round's ends spread over ntg steps
        submit(1 + i * ntg // b)
    t_warm = time.perf_counter() + max(2.0, seconds / 4)
    while time.perf_counter() < t_warm:
        sched.step()
    _sync(rt)
    st0 = dataclasses.replace(sched.stats)
    tokens[0], ttft[:] = 0, []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sched.step()
    _sync(rt)
    dt = time.perf_counter() - t0
    measuring[0] = False
    st = sched.stats
    for sid in list(submitted):
        sched.cancel(sid)
    for s in list(sched.running) + list(sched.prefilling) + list(sched.waiting):
        sched.cancel(s.id)
    while sched.step():
        pass
    n_pre, n_dec = st.prefill_steps - st0.prefill_steps, st.decode_steps - st0.decode_steps
    ms = lambda t, n: 1000 * t / n if n else float("nan")  # noqa: E731
    return (f"| {b} | {tokens[0] / dt:.1f} | {1000 * float(np.median(ttft)):.1f} | "
            f"{1000 * float(np.percentile(ttft, 99)):.1f} | {n_pre} / {n_dec} | "
            f"{ms(st.prefill_step_seconds - st0.prefill_step_seconds, n_pre):.2f} / "
            f"{ms(st.decode_step_seconds - st0.decode_step_seconds, n_dec):.2f} |")


def decode_main(argv):
    ap = argparse.ArgumentParser(prog="bench.py decode")
    ap.add_argument("model")
    ap.add_argument("--npl", default="1,8,16,32")
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--no-programmatic-launch", action="store_true",
                    help="graphs without programmatic dependent launch (each kernel after the last has finished)")
    ap.add_argument("--scheduler", action="store_true", help="through the Scheduler, sampling on the device")
    ap.add_argument("--churn", action="store_true", help="B requests in flight, replaced as they finish")
    ap.add_argument("--seconds", type=float, default=8, help="--churn's measured time")
    ap.add_argument("--temp", type=float, default=0.8, help="--scheduler's and --churn's sampling temperature")
    ap.add_argument("--kv-type", default=None, choices=tuple(KV_TYPE_BYTES), help="the KV cache's type")
    ap.add_argument("--reps", type=int, default=1, help="runs of --ntg steps per B (each after its own prefill): "
                                                        "their mean and standard deviation, as llama-bench -r")
    args = ap.parse_args(argv)
    npl = [int(v) for v in args.npl.split(",")]
    rt = Runtime.load(args.model, device=args.device, n_seq=max(npl), n_ctx=args.npp + args.ntg + 2,
                      cuda=CudaConfig(graphs=not args.eager, programmatic_launch=not args.no_programmatic_launch),
                      kv_type=args.kv_type)
    rng = np.random.default_rng(0)
    if args.churn:
        print("| B | tokens/s | TTFT p50 ms | TTFT p99 ms | prefill / decode steps | ms per prefill / decode step |\n"
              "| --- | --- | --- | --- | --- | --- |")
        for b in npl:
            print(churn_speed(rt, b, args.npp, args.ntg, args.seconds, rng, args.temp), flush=True)
        return
    print(f"| B | {'scheduler' if args.scheduler else 'decode'} t/s |\n| --- | --- |")
    if args.device == "cuda":
        warm_gpu()                     # clocks up: loading the model left the GPU idle for seconds
    for b in npl:
        if args.scheduler:
            scheduler_speed(rt, b, args.npp, 4, rng, args.temp)                # kernels and this size's graph
            runs = [scheduler_speed(rt, b, args.npp, args.ntg, rng, args.temp) for _ in range(args.reps)]
        else:
            runs = [decode_speed(rt, b, args.npp, args.ntg, rng) for _ in range(args.reps)]
        spread = f" ± {np.std(runs, ddof=1):.1f}" if len(runs) > 1 else ""
        print(f"| {b} | {np.mean(runs):.1f}{spread} |", flush=True)


# ---- http ----------------------------------------------------------------------------------------------------------

@dataclass
class StandInConfig(CoreConfig):
    step_ms: float = 10.0


def stand_in_core(cfg: StandInConfig, in_addr: str, out_addr: str) -> None:
    """The engine core's protocol without a model: every step, one random token for each running request."""
    from engine.gguf import GGUFFile
    from engine.tokenizer import Tokenizer

    n_vocab = Tokenizer(GGUFFile(cfg.model)).n_vocab
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(in_addr)
    push.connect(out_addr)
    slots = cfg.n_parallel or 64
    push.send(encoder.encode(Ready(cfg.n_ctx or 4096, n_vocab, slots, "stand-in", 512)))
    rng = np.random.default_rng(0)
    running: dict[int, int] = {}            # rid -> tokens left
    waiting: deque[AddRequest] = deque()
    generated = steps = 0
    while True:
        if pull.poll(0 if running or waiting else 1000):
            while True:
                try:
                    msg = to_core_decoder.decode(pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, AddRequest):
                    waiting.append(msg)
                elif isinstance(msg, Abort):
                    for rid in msg.rids:
                        running.pop(rid, None)
                elif isinstance(msg, Shutdown):
                    return
        while waiting and len(running) < slots:
            req = waiting.popleft()
            running[req.rid] = req.max_tokens
        events = []
        if running:
            time.sleep(cfg.step_ms / 1000)
            steps += 1
            for rid, tok in zip(list(running), rng.integers(300, min(n_vocab, 20000), len(running))):
                events.append(Event(rid, int(tok)))
                running[rid] -= 1
                if running[rid] == 0:
                    del running[rid]
                    events.append(Event(rid, -1, finish="length"))
            generated += len(events)
        push.send(encoder.encode(Outputs(events, CoreStats(running=len(running), waiting=len(waiting),
                                                           generated_tokens_total=generated, steps=steps))))


def serve(model: str, port: int, slots: int, step_ms: float) -> None:
    import uvicorn

    from server.app import ServerConfig, create_app
    cfg = ServerConfig(StandInConfig(model, n_parallel=slots, n_ctx=4096, step_ms=step_ms), core_main=stand_in_core)
    uvicorn.run(create_app(cfg), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def http_main(argv) -> None:
    ap = argparse.ArgumentParser(prog="bench.py http", description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--clients", default="1,8,32,64")
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--procs", type=int, default=None, help="load-generator processes (load_test.py's default)")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="prompts start with load_test.py's N-token system text (long prompts through the front end)")
    args = ap.parse_args(argv)
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(args.model, args.port, args.slots,
                                                                                args.step_ms))
    server.start()
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.time() + 120
    while time.time() < deadline and server.is_alive():
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        sys.exit("bench.py http: the server did not come up")
    print(f"# stand-in core: {args.slots} slots, a step every {args.step_ms} ms; server pid {server.pid}", flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    for c in (int(x) for x in args.clients.split(",")):
        cmd = [sys.executable, os.path.join(here, "load_test.py"), "--url", url, "--clients", str(c), "--seconds",
               str(args.seconds), "--max-tokens", str(args.max_tokens)] + \
            (["--procs", str(args.procs)] if args.procs else []) + \
            (["--shared-prefix", str(args.shared_prefix)] if args.shared_prefix else [])
        out = subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
        ceiling = min(c, args.slots) / args.step_ms * 1000
        print(f"{out} | core ceiling {ceiling:.0f} tokens/s", flush=True)
    server.terminate()
    server.join(5)


def prefix_match_main(argv) -> None:
    from engine.kv_blocks import ROOT, BlockManager
    ap = argparse.ArgumentParser(prog="bench.py prefix-match")
    ap.add_argument("--followers", default="10,100,500,1000")
    ap.add_argument("--prefix", type=int, default=2003)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    blocks = BlockManager(8192, 16)
    prefix = rng.integers(0, 1000, args.prefix)

    def follow() -> None:                                   # a request: the prefix and 12 tokens of its own
        toks = np.concatenate([prefix, rng.integers(0, 1000, 12)])
        table, _, _ = blocks.match(toks, len(toks) - 1)
        for b in table:
            blocks.hold(b)
        parent, i = (blocks.key[table[-1]] if table else ROOT), len(table) * blocks.size
        while i < len(toks):
            b = blocks.allocate()
            table.append(b)
            parent, i = blocks.write(b, parent, 0, toks[i:i + blocks.size]), i + blocks.size
        for b in table:
            blocks.release(b)

    print("| followers | blocks after the prefix | ms per match |\n| --- | --- | --- |")
    done = 0
    for n in (int(v) for v in args.followers.split(",")):
        for _ in range(n - done):
            follow()
        done = n
        toks = np.concatenate([prefix, rng.integers(0, 1000, 12)])
        t0 = time.perf_counter()
        for _ in range(20):
            blocks.match(toks, len(toks) - 1)
        kids = max(len(v) for v in blocks.children.values())
        print(f"| {n} | {kids} | {(time.perf_counter() - t0) / 20 * 1e3:.2f} |", flush=True)


def burst_scenario(model: str, clients: int, prefix_len: int, max_batch_tokens: int, device: str = "cuda"):
    """The shared-prefix burst's engine core (also gpu_profile.py burst's) -> (rt, sched, submit): a Scheduler warmed as
    engine serve warms it, and submit(rnd, i, max_tokens, on_event) queueing request i of round rnd: the prefix_len
    shared tokens and a 20-token question of its own."""
    from engine.sampling import SamplingParams
    from engine.scheduler import Request, Scheduler
    from server.core import warm_up
    rt = Runtime.load(model, device=device, n_ctx=prefix_len + 304, n_seq=clients)
    sched = Scheduler(rt, max_batch_tokens)
    warm_up(rt, max_batch_tokens)                         # every step shape a server captures, as engine serve does
    prefix, greedy = [60 + j % 100 for j in range(prefix_len)], SamplingParams(temperature=0)

    def submit(rnd, i, max_tokens, on_event=lambda e: None):
        question = [5 + (rnd * 37 + i * 7 + j) % 50 for j in range(20)]
        sched.submit(Request(prefix + question, greedy, max_tokens=max_tokens, ignore_eos=True), on_event)
    return rt, sched, submit


def burst_main(argv) -> None:
    from engine.scheduler import TokenEvent
    ap = argparse.ArgumentParser(prog="bench.py burst")
    ap.add_argument("model")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=2000)
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--host-only", action="store_true",
                    help="from the second round, a forward of zero logits: the steps' host work alone")
    ap.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="profile every step; print the N with the most time outside their forward")
    args = ap.parse_args(argv)
    rt, sched, submit = burst_scenario(args.model, args.clients, args.prefix, args.max_batch_tokens, args.device)
    first: dict[int, float] = {}
    steps: list[tuple] = []                                # (rows, logit rows, sequences, forward s)
    forward, stub = rt.forward, [False]

    def zero_logits(tokens, positions, seqs, rows, tables=None):
        xp = np
        if args.device == "cuda":
            import cupy as xp
        return xp.zeros((len(rows), rt.config.n_vocab), xp.float32)

    def timed_forward(tokens, positions, seqs, rows, tables=None):
        t0 = time.perf_counter()
        out = (zero_logits if stub[0] else forward)(tokens, positions, seqs, rows, tables)
        _sync(rt)
        steps.append((len(tokens), len(rows), len(set(seqs)), time.perf_counter() - t0))
        return out
    rt.forward = timed_forward

    def request(rnd, i, max_tokens):
        submit(rnd, i, max_tokens, lambda e: isinstance(e, TokenEvent) and first.setdefault(i, time.perf_counter()))

    profiled: list[tuple[float, float, object]] = []       # (step s, forward s, cProfile.Profile) of every step
    if args.profile_steps:
        sched.step = profiled_steps(sched.step, steps, profiled)

    for rnd in range(args.rounds):
        stub[0] = args.host_only and rnd > 0           # round 0 fills the cache with the shared prefix
        request(rnd, -1, 4)
        while sched.step():
            pass
        first.clear()
        steps.clear()
        t0 = time.perf_counter()
        for i in range(args.clients):
            request(rnd, i, 16)
        step_s = []                                        # (start, seconds) of each step
        while True:
            s0 = time.perf_counter()
            if not sched.step():
                break
            step_s.append((s0, time.perf_counter() - s0))
        ttft = np.array(sorted(first[i] - t0 for i in range(args.clients))) * 1000
        print(f"round {rnd}: {args.clients} requests, max_batch_tokens {args.max_batch_tokens}: TTFT p50 "
              f"{np.percentile(ttft, 50):.1f} ms, first {ttft[0]:.1f}, last {ttft[-1]:.1f}", flush=True)
        print("  steps until every first token (rows, logit rows, sequences, forward ms, step ms): " + ", ".join(
            f"({a}, {b}, {c}, {d * 1000:.1f}, {e * 1000:.1f})" for (a, b, c, d), (start, e) in zip(steps, step_s)
            if start < max(first.values())), flush=True)
    for step_s_, forward_s, prof in sorted(profiled, key=lambda p: p[1] - p[0])[:args.profile_steps]:
        print(f"== a step of {step_s_ * 1000:.1f} ms, {forward_s * 1000:.1f} in its forward", flush=True)
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(12)


def profiled_steps(step, forwards: list, out: list):
    """step (a Scheduler's) run under cProfile each call, appending (seconds, its forward's seconds, the profile) to
    out; forwards: the timed forwards' records (rows, logit rows, sequences, seconds), one appended per forward."""
    def run():
        prof, n_before, t0 = cProfile.Profile(), len(forwards), time.perf_counter()
        prof.enable()
        try:
            return step()
        finally:
            prof.disable()
            forward_s = forwards[-1][3] if len(forwards) > n_before else 0.0
            out.append((time.perf_counter() - t0, forward_s, prof))
    return run


COMMANDS = {"mul-mat": mul_mat_main, "attention": attention_main, "norm": norm_main, "decode": decode_main,
            "http": http_main, "prefix-match": prefix_match_main, "burst": burst_main}


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__.split("\n\n")[1] if len(sys.argv) < 2 else f"unknown benchmark {sys.argv[1]!r}", file=sys.stderr)
        sys.exit(2)
    COMMANDS[sys.argv[1]](sys.argv[2:])
