#!/usr/bin/env python3
"""Where a forward pass spends its time on the GPU: per backend operation, and decode as graph vs whole step.

    python scripts/profile_step.py MODEL [--prompt 512] [--steps 64]

prefill: one ubatch of --prompt tokens run eagerly with CUDA events around every backend operation (mul_mat split by
the path dispatch takes); where the host enqueues ahead of the kernels (large models) the event times are GPU times,
elsewhere they include launch gaps. Where glu falls back to two mul_mats (above 8 tokens) their times are
counted under both glu and mul_mat.
Then the same ubatch replayed from a CUDA graph: the whole prefill call and the replay alone.
decode: the mean wall time of a whole decode step (Runtime.decode: input copy, graph replay, logits copy), of the
graph replay alone (launch + synchronize), and of an eager step (graphs off).
"""
import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.cuda import dispatch  # noqa: E402
from engine.runtime import Runtime  # noqa: E402

OPS = ("embed", "mul_mat", "mul_mats", "glu", "rms_norm", "add_rms_norm", "rope", "attention", "swiglu", "geglu", "add", "scale",
       "rows")


def profile_prefill(rt, n):
    import cupy as cp
    B = rt.backend
    records = []
    originals = {name: getattr(B, name) for name in OPS}

    def wrap(name, fn):
        def timed(*args, **kw):
            label = name
            if name in ("mul_mat", "glu"):
                label = f"{name}/{dispatch.choose_path(args[0], args[-1 if name == 'mul_mat' else 2].shape[0])}"
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(B.stream)
            out = fn(*args, **kw)
            b.record(B.stream)
            records.append((label, a, b))
            return out
        return timed

    tokens = np.random.default_rng(0).integers(100, rt.config.n_vocab - 100, n).tolist()
    graphs, B.graphs = B.graphs, None                    # eager, so that every operation can be timed
    rt.prefill(tokens)                                   # warm-up: compile and load every kernel
    B.synchronize()
    for name in OPS:
        setattr(B, name, wrap(name, originals[name]))
    t0 = time.perf_counter()
    rt.prefill(tokens)
    B.synchronize()
    wall = time.perf_counter() - t0
    for name in OPS:
        setattr(B, name, originals[name])
    B.graphs = graphs
    totals, counts = defaultdict(float), defaultdict(int)
    for label, a, b in records:
        totals[label] += cp.cuda.get_elapsed_time(a, b)
        counts[label] += 1
    gpu = sum(totals.values())
    print(f"prefill {n} tokens: wall {wall * 1e3:.2f} ms ({n / wall:,.0f} t/s), sum of op GPU times {gpu:.2f} ms")

    for label in sorted(totals, key=totals.get, reverse=True):
        print(f"  {label:<22} {counts[label]:>5} calls {totals[label]:8.3f} ms {100 * totals[label] / gpu:5.1f} %")
    if B.graphs is None:
        return
    for _ in range(2):                                   # eager, then captured (the second ubatch of this length)
        rt.prefill(tokens)
    B.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        rt.prefill(tokens)
    B.synchronize()
    whole = (time.perf_counter() - t0) / 10
    line = f"prefill {n} tokens from a graph: whole call {whole * 1e3:.2f} ms ({n / whole:,.0f} t/s)"
    if B.graphs.prefill:
        graph = next(reversed(B.graphs.prefill.values()))
        t0 = time.perf_counter()
        for _ in range(10):
            graph.graph.launch(stream=B.stream)
        B.synchronize()
        replay = (time.perf_counter() - t0) / 10
        line += f", graph replay alone {replay * 1e3:.2f} ms ({n / replay:,.0f} t/s)"
    print(line)


def profile_decode(rt, steps):
    B = rt.backend
    rng = np.random.default_rng(1)
    toks = rng.integers(100, rt.config.n_vocab - 100, steps).tolist()
    for pos in range(4):
        rt.decode([0], [toks[pos]], [pos])               # eager first step, capture
    B.synchronize()
    t0 = time.perf_counter()
    for pos in range(steps):
        rt.decode([0], [toks[pos]], [pos])
    step = (time.perf_counter() - t0) / steps
    graph = next(iter(B.graphs.steps.values())) if B.graphs and B.graphs.steps else None
    line = f"decode: whole step {step * 1e6:.0f} us ({1 / step:.0f} t/s)"
    if graph is not None:
        B.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            graph.graph.launch(stream=B.stream)
        B.synchronize()
        replay = (time.perf_counter() - t0) / steps
        line += f", graph replay alone {replay * 1e6:.0f} us ({1 / replay:.0f} t/s)"
    graphs, B.graphs = B.graphs, None
    rt.decode([0], [toks[0]], [0])
    B.synchronize()
    t0 = time.perf_counter()
    for pos in range(steps):
        rt.decode([0], [toks[pos]], [pos])
    eager = (time.perf_counter() - t0) / steps
    B.graphs = graphs
    print(line + f", eager step {eager * 1e6:.0f} us ({1 / eager:.0f} t/s)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    rt = Runtime.load(args.model, device="cuda", n_ubatch=args.prompt)
    print(f"== {Path(rt.gguf.path).name}")
    profile_prefill(rt, args.prompt)
    profile_decode(rt, args.steps)


if __name__ == "__main__":
    main()
