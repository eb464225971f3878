"""Decode speed at depth on the CPU backend by KV block size (the paged cache's KV_BLOCK_SIZE).

    python scripts/kv_block_size.py [MODEL] [--depth 1024] [--steps 32] [--sizes 16 32 64 256]

One sequence: a prompt of --depth random tokens prefilled, then --steps decode steps timed (median ms per step);
a size at least the context is one block per sequence (no block table to gather through).
"""
import argparse
import statistics
import time

import numpy as np

import engine.runtime as runtime_module
from engine.runtime import Runtime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--depth", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 32, 64, 256, 1 << 20])
    args = ap.parse_args()
    n_ctx = args.depth + args.steps + 1
    prompt = np.random.default_rng(0).integers(0, 1000, args.depth).tolist()
    print(f"| block size | decode ms/step at depth {args.depth} |\n| --- | --- |")
    for size in args.sizes:
        runtime_module.KV_BLOCK_SIZE = size
        rt = Runtime.load(args.model, device="cpu", n_ctx=n_ctx)
        rt.prefill(prompt, logits=False)
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            rt.decode([0], [i + 1], [args.depth + i])
            times.append(time.perf_counter() - t0)
        label = "whole context" if rt.block_size >= n_ctx else str(rt.block_size)
        print(f"| {label} | {1000 * statistics.median(times):.2f} |")


if __name__ == "__main__":
    main()
