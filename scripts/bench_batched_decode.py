#!/usr/bin/env python3
"""Batched decode speed, llama-batched-bench style: B sequences each prefilled with npp random tokens, then ntg decode
steps of all B at once (greedy, the argmax taken on the device); generated tokens/s = B * ntg / time of the steps.

    python scripts/bench_batched_decode.py MODEL [--npl 1,8,16,32] [--npp 128] [--ntg 128] [--device cuda]
    python scripts/bench_batched_decode.py MODEL --scheduler [--temp 0.8]

--scheduler measures the engine core as `engine serve` runs it, without HTTP: B requests submitted to the Scheduler
at once (prefilled together), then decoded with sampling on the device; tokens/s from the step where all B are
decoding to the last.

ANCHORS.md's llama.cpp figures: `llama-batched-bench -npp 128 -ntg 128 -npl B -fa on`.
"""
import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench import _sync  # noqa: E402
from engine.runtime import Runtime  # noqa: E402


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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--npl", default="1,8,16,32")
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scheduler", action="store_true", help="through the Scheduler, sampling on the device")
    ap.add_argument("--temp", type=float, default=0.8, help="--scheduler's sampling temperature")
    args = ap.parse_args()
    npl = [int(v) for v in args.npl.split(",")]
    rt = Runtime.load(args.model, device=args.device, n_seq=max(npl), n_ctx=args.npp + args.ntg + 2)
    rng = np.random.default_rng(0)
    print(f"| B | {'scheduler' if args.scheduler else 'decode'} t/s |\n| --- | --- |")
    for b in npl:
        if args.scheduler:
            scheduler_speed(rt, b, args.npp, 4, rng, args.temp)                # kernels and this size's graph
            speed = scheduler_speed(rt, b, args.npp, args.ntg, rng, args.temp)
        else:
            speed = decode_speed(rt, b, args.npp, args.ntg, rng)
        print(f"| {b} | {speed:.1f} |", flush=True)


if __name__ == "__main__":
    main()
