"""`engine bench`: prompt-processing and generation speed, llama-bench style (mean ± sd over repetitions)."""
from __future__ import annotations

import statistics
import time

import numpy as np

from .runtime import Runtime


def _sync(rt: Runtime) -> None:
    sync = getattr(rt.backend, "synchronize", None)
    if sync:
        sync()


def bench_pp(rt: Runtime, n_prompt: int, rng) -> float:
    tokens = rng.integers(100, rt.config.n_vocab - 100, n_prompt).tolist()
    _sync(rt)
    t0 = time.perf_counter()
    rt.prefill(tokens)
    _sync(rt)
    return n_prompt / (time.perf_counter() - t0)


def bench_tg(rt: Runtime, n_gen: int, rng) -> float:
    tok = int(rng.integers(100, rt.config.n_vocab - 100))
    _sync(rt)
    t0 = time.perf_counter()
    for pos in range(n_gen):
        tok = int(rt.decode([0], [tok], [pos], greedy=True)[0])       # greedy, the argmax taken by the backend
    _sync(rt)
    return n_gen / (time.perf_counter() - t0)


def run_bench(rt: Runtime, n_prompt: int, n_gen: int, reps: int, warmup: bool = True) -> list[dict]:
    rng = np.random.default_rng(0)
    rows = []
    for name, n, fn in (("pp", n_prompt, bench_pp), ("tg", n_gen, bench_tg)):
        if n <= 0:
            continue
        if warmup:     # load the kernels; capture the decode graph (first step) or the prefill graph (second run)
            for _ in range(2 if name == "pp" else 1):
                fn(rt, n if name == "pp" else min(n, 16), rng)
        speeds = [fn(rt, n, rng) for _ in range(reps)]
        rows.append({"test": f"{name}{n}", "mean": statistics.mean(speeds),
                     "sd": statistics.stdev(speeds) if len(speeds) > 1 else 0.0, "runs": speeds})
    return rows


def format_table(model: str, device: str, rows: list[dict], n_ubatch: int) -> str:
    lines = ["| model | device | n_ubatch | test | t/s |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {model} | {device} | {n_ubatch} | {r['test']} | {r['mean']:.2f} ± {r['sd']:.2f} |")
    return "\n".join(lines)
