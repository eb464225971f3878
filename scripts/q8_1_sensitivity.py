#!/usr/bin/env python3
"""How far q8_1-rounded activations move the tests' tiny random models (CPU only, no GPU code involved).

    python scripts/q8_1_sensitivity.py [--arch llama] [--prompts 40] [--round q8_1|f16]

Builds the tiny model of tests/tiny_models.py (fixed seed), then for random 40-token prompts (seeds 0..N-1) compares
the CPU backend's prefill logits with those of the same backend whose every mul_mat first rounds its activations to
q8_1 as MMVQ and MMQ see them (tests/gpu_rounding.py; 8-token ubatches), and prints the nmse's distribution. --round
f16 rounds the activations and weights to f16 instead (the dequantize+cuBLAS path's inputs; the f16 KV cache is not
modelled). "above" counts the prompts over the bounds tests/test_tiny_models.py used when it compared the GPU with the
float CPU (1e-2, 1e-4): this gap is why it now compares with the rounding CPU.
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from gpu_rounding import round_like_gpu  # noqa: E402
from test_tiny_models import nmse  # noqa: E402
from tiny_models import N_VOCAB, write_tiny  # noqa: E402

from engine.runtime import Runtime  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="llama", choices=["llama", "gemma3"])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--round", default="q8_1", choices=["q8_1", "f16"])
    args = ap.parse_args()
    path = write_tiny(os.path.join(tempfile.mkdtemp(), f"{args.arch}.gguf"), args.arch)
    errs = []
    for seed in range(args.prompts):
        prompt = np.random.default_rng(seed).integers(0, N_VOCAB, 40).tolist()
        ref = Runtime.load(path, device="cpu", n_ctx=64).prefill(prompt, all_logits=True)
        with pytest.MonkeyPatch.context() as mp:
            round_like_gpu(mp, lambda n: args.round, kv_f16=False)
            out = Runtime.load(path, device="cpu", n_ctx=64, n_ubatch=8).prefill(prompt, all_logits=True)
        errs.append(nmse(out, ref))
    e = np.array(errs)
    bound = 1e-2 if args.round == "q8_1" else 1e-4
    print(f"{args.arch}, {args.round}: {len(e)} prompts, nmse median {np.median(e):.2e}, p90 "
          f"{np.percentile(e, 90):.2e}, max {e.max():.2e}, above {bound:g}: {np.mean(e > bound):.0%}")


if __name__ == "__main__":
    main()
