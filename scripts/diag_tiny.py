#!/usr/bin/env python3
"""Diagnostic: GPU vs CPU logits on the tiny random models of tests/tiny_models.py, per mul_mat path, over random
prompts: nmse against the plain float CPU and against the CPU that rounds as the GPU does (tests/gpu_rounding.py).

    python scripts/diag_tiny.py [--prompts 20]

Each case as tests/test_tiny_models.py runs it: a 40-token prompt (prefill, all logits) then 5 decode steps.
Prints per (arch, path, cache) the median / max nmse of both comparisons and the least argmax agreement.
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

from gpu_rounding import dispatch_rounding, round_like_gpu  # noqa: E402
from test_tiny_models import nmse, run  # noqa: E402
from tiny_models import N_VOCAB, write_tiny  # noqa: E402

from engine.runtime import Runtime  # noqa: E402

# (path forced, ubatch, kv_f32): the cases of test_cuda_q8_1_paths and test_cuda_dequant_path_matches_cpu
CASES = [("mmvq", 8, False), ("mmq", 32, False), (None, 32, False), ("dequant", 32, False), ("dequant", 32, True)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=20)
    args = ap.parse_args()
    d = tempfile.mkdtemp()
    print("| arch | path | ubatch | cache | nmse vs float CPU: median / max | vs rounding CPU: median / max "
          "| least argmax agreement (rounding CPU) |")
    print("| --- " * 7 + "|")
    for arch in ("llama", "gemma3"):
        path = write_tiny(os.path.join(d, arch + ".gguf"), arch)
        for forced, ubatch, kv_f32 in CASES:
            plain, rounded, agree = [], [], []
            for seed in range(args.prompts):
                rng = np.random.default_rng(seed)
                prompt, dec = rng.integers(0, N_VOCAB, 40).tolist(), rng.integers(0, N_VOCAB, 5).tolist()
                with pytest.MonkeyPatch.context() as mp:
                    if forced:
                        mp.setenv("ENGINE_MUL_MAT_PATH", forced)
                    else:
                        mp.delenv("ENGINE_MUL_MAT_PATH", raising=False)
                    gpu = run(Runtime.load(path, device="cuda", n_ctx=64, n_ubatch=ubatch, kv_f32=kv_f32), prompt,
                              dec)
                    cpu = run(Runtime.load(path, device="cpu", n_ctx=64, n_ubatch=ubatch), prompt, dec)
                    round_like_gpu(mp, dispatch_rounding(forced), kv_f16=not kv_f32)
                    ref = run(Runtime.load(path, device="cpu", n_ctx=64, n_ubatch=ubatch), prompt, dec)
                plain.append(nmse(gpu, cpu))
                rounded.append(nmse(gpu, ref))
                agree.append(float(np.mean(gpu.argmax(1) == ref.argmax(1))))
            print(f"| {arch} | {forced or 'chosen'} | {ubatch} | {'f32' if kv_f32 else 'f16'} | "
                  f"{np.median(plain):.1e} / {max(plain):.1e} | {np.median(rounded):.1e} / {max(rounded):.1e} | "
                  f"{min(agree):.2f} |", flush=True)


if __name__ == "__main__":
    main()
