#!/usr/bin/env python3
"""Batched decode speed, llama-batched-bench style: B sequences each prefilled with npp random tokens, then ntg decode
steps of all B at once (greedy, the argmax taken on the device); generated tokens/s = B * ntg / time of the steps.

    python scripts/bench_batched_decode.py MODEL [--npl 1,8,16,32] [--npp 128] [--ntg 128] [--device cuda]
    python scripts/bench_batched_decode.py MODEL --scheduler [--temp 0.8]
    python scripts/bench_batched_decode.py MODEL --churn [--npp 12 --ntg 64 --seconds 8]

--scheduler measures the engine core as `engine serve` runs it, without HTTP: B requests submitted to the Scheduler
at once (prefilled together), then decoded with sampling on the device; tokens/s from the step where all B are
decoding to the last.

--churn measures the engine core under a server's load, without HTTP: B requests in flight at all times, each
replaced by a new one (a fresh npp-token prompt) as it finishes, their ends spread out as a server's clients'; so most
steps carry a prompt or two beside the decode rows. Prints tokens/s, TTFT (submit to first token) and the steps.

ANCHORS.md's llama.cpp figures: `llama-batched-bench -npp 128 -ntg 128 -npl B -fa on`.
"""
import argparse
import dataclasses
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--npl", default="1,8,16,32")
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=128)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--scheduler", action="store_true", help="through the Scheduler, sampling on the device")
    ap.add_argument("--churn", action="store_true", help="B requests in flight, replaced as they finish")
    ap.add_argument("--seconds", type=float, default=8, help="--churn's measured time")
    ap.add_argument("--temp", type=float, default=0.8, help="--scheduler's and --churn's sampling temperature")
    args = ap.parse_args()
    npl = [int(v) for v in args.npl.split(",")]
    rt = Runtime.load(args.model, device=args.device, n_seq=max(npl), n_ctx=args.npp + args.ntg + 2)
    rng = np.random.default_rng(0)
    if args.churn:
        print("| B | tokens/s | TTFT p50 ms | TTFT p99 ms | prefill / decode steps | ms per prefill / decode step |\n"
              "| --- | --- | --- | --- | --- | --- |")
        for b in npl:
            print(churn_speed(rt, b, args.npp, args.ntg, args.seconds, rng, args.temp), flush=True)
        return
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
