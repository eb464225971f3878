#!/usr/bin/env python3
"""How far q8_1-rounded activations move the tests' tiny random models (CPU only, no GPU code involved).

    python scripts/q8_1_sensitivity.py [--arch llama] [--prompts 40] [--round q8_1|f16]

Builds the tiny model of tests/tiny_models.py (fixed seed), then for random 40-token prompts (seeds 0..N-1) compares
the CPU backend's prefill logits with those of the same backend whose every mul_mat first rounds its activations to
q8_1 (the numpy reference of quantize_q8_1, as MMVQ and MMQ see them; 8-token ubatches): the nmse that
tests/test_tiny_models.py::test_cuda_q8_1_paths bounds by 1e-2 on the GPU. Prints its distribution. --round f16
rounds the activations and weights to f16 instead (the dequantize+cuBLAS path's inputs; the GPU's f16 KV cache is
not modelled), the nmse that test_cuda_dequant_path_matches_cpu bounds by 1e-4 (prefill only here).
"""
import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_cuda_kernels import q8_1_ref  # noqa: E402
from tiny_models import N_VOCAB, write_tiny  # noqa: E402

from engine.backends import cpu as cpu_backend  # noqa: E402
from engine.runtime import Runtime  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="llama", choices=["llama", "gemma3"])
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--round", default="q8_1", choices=["q8_1", "f16"])
    args = ap.parse_args()
    path = write_tiny(os.path.join(tempfile.mkdtemp(), f"{args.arch}.gguf"), args.arch)
    float_mul_mat = cpu_backend.CPUBackend.mul_mat

    def rounded_mul_mat(self, w, x):
        if args.round == "f16":
            return (x.astype(np.float16).astype(np.float64) @ w.T.astype(np.float16).astype(np.float64)).astype(x.dtype)
        _, xq = q8_1_ref(np.ascontiguousarray(x, dtype=np.float32))
        return (xq @ w.T.astype(np.float64)).astype(x.dtype)

    errs = []
    for seed in range(args.prompts):
        prompt = np.random.default_rng(seed).integers(0, N_VOCAB, 40).tolist()
        cpu_backend.CPUBackend.mul_mat = float_mul_mat
        ref = Runtime.load(path, device="cpu", n_ctx=64).prefill(prompt, all_logits=True)
        cpu_backend.CPUBackend.mul_mat = rounded_mul_mat
        out = Runtime.load(path, device="cpu", n_ctx=64, n_ubatch=8).prefill(prompt, all_logits=True)
        errs.append(float(np.sum((out - ref) ** 2) / np.sum(ref ** 2)))
    cpu_backend.CPUBackend.mul_mat = float_mul_mat
    e = np.array(errs)
    bound = 1e-2 if args.round == "q8_1" else 1e-4
    print(f"{args.arch}, {args.round}: {len(e)} prompts, nmse median {np.median(e):.2e}, p90 "
          f"{np.percentile(e, 90):.2e}, max {e.max():.2e}, above {bound:g}: {np.mean(e > bound):.0%}")


if __name__ == "__main__":
    main()
