"""Decode speed at depth on the CPU backend by KV block size, block layout and cache type.

    python scripts/kv_cache_cpu.py [MODEL] [--depth 1024] [--steps 32] [--sizes 16 32 64 256 | --layouts | --types]

One sequence: a prompt of --depth random tokens prefilled, then --steps decode steps timed (median ms per step);
a size at least the context is one block per sequence (no block table to gather through). --layouts: four
sequences decoding together at --depth, their blocks of KV_BLOCK_SIZE consecutive, scattered at random, or one
whole-context block each. --types: one sequence with an f32, f16 and q8_0 cache.
"""
import argparse
import statistics
import time

import numpy as np

import engine.runtime as runtime_module
from engine.backends.cpu import CPUBackend
from engine.runtime import Runtime


def step_ms(rt, tokens, positions, seqs, tables, steps) -> float:
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        rt.forward(tokens, [p + i for p in positions], seqs, list(range(len(seqs))), tables)
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def sizes(args, prompt) -> None:
    n_ctx = args.depth + args.steps + 1
    print(f"| block size | decode ms/step at depth {args.depth} |\n| --- | --- |")
    for size in args.sizes:
        runtime_module.KV_BLOCK_SIZE = size
        rt = Runtime.load(args.model, device="cpu", n_ctx=n_ctx)
        rt.prefill(prompt, logits=False)
        label = "whole context" if rt.block_size >= n_ctx else str(rt.block_size)
        print(f"| {label} | {step_ms(rt, [1], [args.depth], [0], None, args.steps):.2f} |")


def layouts(args, prompt, rng) -> None:
    n_ctx, d = args.depth + args.steps + 1, args.depth
    print(f"| 4 sequences at depth {d}: blocks | decode ms/step |\n| --- | --- |")
    for label in ("whole context", "consecutive", "scattered"):
        CPUBackend.paged_kv = label != "whole context"
        rt = Runtime.load(args.model, device="cpu", n_ctx=n_ctx, n_seq=4)
        tables = None
        if label == "scattered":
            perm = rng.permutation(rt.n_blocks)
            tables = {s: perm[s * rt.blocks_per_seq:(s + 1) * rt.blocks_per_seq].tolist() for s in range(4)}
        for s in range(4):
            rt.forward(prompt, list(range(d)), [s] * d, [d - 1], tables)
        print(f"| {label} | {step_ms(rt, [1, 2, 3, 4], [d] * 4, [0, 1, 2, 3], tables, args.steps):.2f} |")
    CPUBackend.paged_kv = True


def types(args, prompt) -> None:
    print(f"| KV type | decode ms/step at depth {args.depth} |\n| --- | --- |")
    for kv_type in (None, "f16", "q8_0"):
        rt = Runtime.load(args.model, device="cpu", n_ctx=args.depth + args.steps + 1, kv_type=kv_type)
        rt.prefill(prompt, logits=False)
        print(f"| {kv_type or 'f32'} | {step_ms(rt, [1], [args.depth], [0], None, args.steps):.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--depth", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 256, 1 << 20])
    ap.add_argument("--layouts", action="store_true")
    ap.add_argument("--types", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 1000, args.depth).tolist()
    if args.layouts:
        layouts(args, prompt, rng)
    elif args.types:
        types(args, prompt)
    else:
        sizes(args, prompt)


if __name__ == "__main__":
    main()
