#!/usr/bin/env python3
"""Where the GPU time goes, one entry point:

    python scripts/gpu_profile.py step MODEL [--prompt 512] [--steps 64]
    python scripts/gpu_profile.py ncu-decode MODEL [B] [DEPTH]
    python scripts/gpu_profile.py burst MODEL [--clients 32] [--prefix 2000] [--max-batch-tokens 512]

step: where a forward pass spends its time on the GPU, per backend operation, and decode as graph vs whole step.
prefill: one ubatch of --prompt tokens run eagerly with CUDA events around every backend operation (mul_mat split by
the path dispatch takes); where the host enqueues ahead of the kernels (large models) the event times are GPU times,
elsewhere they include launch gaps. Where glu falls back to two mul_mats (above 8 tokens) their times are
counted under both glu and mul_mat.
Then the same ubatch replayed from a CUDA graph: the whole prefill call and the replay alone.
decode: the mean wall time of a whole decode step (Runtime.decode: input copy, graph replay, logits copy), of the
graph replay alone (launch + synchronize), and of an eager step (graphs off).

burst: the step that admits a burst of requests sharing a cached prefix (bench.py burst's scenario: the Scheduler
warmed as engine serve warms it, one request, then --clients at once), CUDA events around every backend operation of
that step, and the step's and its forward's wall time; the third round is timed (the first two compile and cache).

ncu-decode: per-kernel GPU time of one decode step of B sequences (1; each first prefilled with DEPTH tokens, 64), read by
Nsight Compute (ncu on the PATH): two eager decode steps under
`ncu --clock-control none --csv --page raw --metrics gpu__time_duration.sum`, the time per kernel name of the second
step, largest first, with the step's total.
"""
import argparse
import contextlib
import csv
import io
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.cuda import dispatch  # noqa: E402
from engine.cuda.config import CudaConfig  # noqa: E402
from engine.runtime import Runtime  # noqa: E402

OPS = ("embed", "mul_mat", "mul_mats", "glu", "rms_norm", "add_rms_norm", "rope", "attention", "swiglu", "geglu", "add", "scale",
       "rows")


class OpTimer:
    """CUDA events around every backend operation (OPS) while on; mul_mat, mul_mats and glu labelled by the path
    dispatch takes. Eager steps only (events are not recorded inside a graph capture)."""

    def __init__(self, backend):
        self.backend, self.records = backend, []
        self.originals = {name: getattr(backend, name) for name in OPS}

    def __enter__(self):
        import cupy as cp
        B = self.backend

        def wrap(name, fn):
            def timed(*args, **kw):
                label = name
                if name in ("mul_mat", "mul_mats", "glu"):
                    w = args[0][0] if name == "mul_mats" else args[0]
                    x = args[2] if name == "glu" else args[-1]
                    label = f"{name}/{dispatch.choose_path(w, x.shape[0])}"
                a, b = cp.cuda.Event(), cp.cuda.Event()
                a.record(B.stream)
                out = fn(*args, **kw)
                b.record(B.stream)
                self.records.append((label, a, b))
                return out
            return timed
        for name, fn in self.originals.items():
            setattr(B, name, wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(self.backend, name, fn)

    def report(self, title: str) -> None:
        import cupy as cp
        self.backend.synchronize()
        totals, counts = defaultdict(float), defaultdict(int)
        for label, a, b in self.records:
            totals[label] += cp.cuda.get_elapsed_time(a, b)
            counts[label] += 1
        gpu = sum(totals.values())
        print(f"{title}, sum of op GPU times {gpu:.2f} ms")
        for label in sorted(totals, key=totals.get, reverse=True):
            print(f"  {label:<22} {counts[label]:>5} calls {totals[label]:8.3f} ms {100 * totals[label] / gpu:5.1f} %")


def profile_prefill(rt, n):
    B = rt.backend
    tokens = np.random.default_rng(0).integers(100, rt.config.n_vocab - 100, n).tolist()
    graphs, B.graphs = B.graphs, None                    # eager, so that every operation can be timed
    rt.prefill(tokens)                                   # warm-up: compile and load every kernel
    B.synchronize()
    with OpTimer(B) as timer:
        t0 = time.perf_counter()
        rt.prefill(tokens)
        B.synchronize()
        wall = time.perf_counter() - t0
    B.graphs = graphs
    timer.report(f"prefill {n} tokens: wall {wall * 1e3:.2f} ms ({n / wall:,.0f} t/s)")
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


def ncu_step(model: str, b: int, depth: int = 64) -> None:
    """What ncu-decode profiles (run under ncu): b sequences prefilled with depth tokens, then two eager decode steps
    between cudaProfilerStart and Stop (the first loads the kernels' modules)."""
    import cupy
    rt = Runtime.load(model, device="cuda", n_ctx=max(512, depth + 8), n_seq=b, cuda=CudaConfig(graphs=False))
    for seq in range(b):
        rt.prefill([100 + (seq + i) % 1000 for i in range(depth)], seq=seq, logits=False)
    rt.backend.synchronize()
    cupy.cuda.profiler.start()                           # ncu --profile-from-start off: the two steps alone
    rt.decode(list(range(b)), [200] * b, [depth] * b)
    rt.decode(list(range(b)), [201] * b, [depth + 1] * b)
    rt.backend.synchronize()
    cupy.cuda.profiler.stop()


def ncu_decode(model: str, b: int, depth: int = 64) -> None:
    """Nsight Compute's per-kernel times of the second of two eager decode steps of b sequences at depth."""
    cmd = ["ncu", "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw", "--metrics",
           "gpu__time_duration.sum", sys.executable, __file__, "ncu-step", model, str(b), str(depth)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith('"')]
    if not lines:
        print("ncu gave no rows:", r.stdout[-2000:], r.stderr[-2000:])
        raise SystemExit(1)
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    rows = [row for row in rows if row.get("ID", "").isdigit()]
    key = next(k for k in rows[0] if "gpu__time_duration" in k)
    # the last two decode steps launch the same kernels: take the last half of the final 2*s launches
    names = [row["Kernel Name"] for row in rows]
    times = [float(row[key].replace(",", "")) for row in rows]
    step = None
    for s in range(len(names) // 2, 0, -1):
        if names[-s:] == names[-2 * s:-s]:
            step = s
            break
    if step is None:
        print("could not find two equal decode steps")
        raise SystemExit(1)
    totals, counts = defaultdict(float), defaultdict(int)
    for nm, t in zip(names[-step:], times[-step:]):
        short = nm.split("(")[0][:60]
        totals[short] += t
        counts[short] += 1
    total = sum(totals.values())
    print(f"{model}: one decode step of {b} sequences = {step} kernels, {total / 1000:.1f} us of kernel time (from ncu)")
    for nm in sorted(totals, key=totals.get, reverse=True):
        print(f"  {nm:<62} {counts[nm]:>4} x {totals[nm] / counts[nm] / 1000:7.2f} us = {totals[nm] / 1000:8.1f} us "
              f"{100 * totals[nm] / total:5.1f} %")


def profile_burst(model: str, clients: int, prefix_len: int, max_batch_tokens: int) -> None:
    from bench import burst_scenario
    rt, sched, submit = burst_scenario(model, clients, prefix_len, max_batch_tokens)
    forward, forwards = rt.forward, []

    def timed_forward(*args):
        t0 = time.perf_counter()
        out = forward(*args)
        rt.backend.synchronize()
        forwards.append((len(args[0]), len(set(args[2])), time.perf_counter() - t0))
        return out
    rt.forward = timed_forward

    timer = OpTimer(rt.backend)
    for rnd in range(3):
        submit(rnd, -1, 4)
        while sched.step():
            pass
        for i in range(clients):
            submit(rnd, i, 4)
        forwards.clear()
        with timer if rnd == 2 else contextlib.nullcontext():
            t0 = time.perf_counter()
            sched.step()
            step = time.perf_counter() - t0
        while sched.step():
            pass
    rows, seqs, fwd = forwards[0]
    timer.report(f"the step admitting {clients} requests: {rows} rows of {seqs} sequences, step {step * 1e3:.1f} ms, "
                 f"forward {fwd * 1e3:.1f} ms")


def main():
    ap = argparse.ArgumentParser(prog="gpu_profile.py")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("step", help="per operation, prefill and decode")
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--steps", type=int, default=64)
    for name in ("ncu-decode", "ncu-step"):
        p = sub.add_parser(name, help="Nsight Compute's per-kernel times of one decode step" if name == "ncu-decode"
                           else "(what ncu-decode runs under ncu)")
        p.add_argument("model")
        p.add_argument("b", nargs="?", type=int, default=1)
        p.add_argument("depth", nargs="?", type=int, default=64)
    p = sub.add_parser("burst", help="per operation, the step admitting a burst that shares a cached prefix")
    p.add_argument("model")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--prefix", type=int, default=2000)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    args = ap.parse_args()
    if args.cmd == "burst":
        profile_burst(args.model, args.clients, args.prefix, args.max_batch_tokens)
    elif args.cmd == "step":
        rt = Runtime.load(args.model, device="cuda", n_ubatch=args.prompt)
        print(f"== {Path(rt.gguf.path).name}")
        profile_prefill(rt, args.prompt)
        profile_decode(rt, args.steps)
    elif args.cmd == "ncu-decode":
        ncu_decode(args.model, args.b, args.depth)
    else:
        ncu_step(args.model, args.b, args.depth)


if __name__ == "__main__":
    main()
