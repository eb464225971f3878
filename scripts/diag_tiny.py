"""Diagnostic: CPU vs CUDA logits on the tiny random models, per mul_mat path (prints nmse)."""
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from tiny_models import N_VOCAB, write_tiny  # noqa: E402

from engine.runtime import Runtime  # noqa: E402

rng = np.random.default_rng(0)
prompt = rng.integers(0, N_VOCAB, 40).tolist()
with tempfile.TemporaryDirectory() as d:
    for arch in ("llama", "gemma3"):
        path = write_tiny(os.path.join(d, arch + ".gguf"), arch)
        cpu = Runtime.load(path, device="cpu", n_ctx=64, n_ubatch=64).prefill(prompt, all_logits=True)
        for p in ("dequant", "mmq", "mmvq8"):
            if p == "mmvq8":
                os.environ["ENGINE_MUL_MAT_PATH"] = "mmvq"
                rt = Runtime.load(path, device="cuda", n_ctx=64, n_ubatch=8)
            else:
                os.environ["ENGINE_MUL_MAT_PATH"] = p
                rt = Runtime.load(path, device="cuda", n_ctx=64, n_ubatch=64)
            g = rt.prefill(prompt, all_logits=True)
            e = np.sum((g - cpu) ** 2) / np.sum(cpu ** 2)
            print(arch, p, f"nmse {e:.3g}", "argmax agree", np.mean(g.argmax(1) == cpu.argmax(1)),
                  "logit std", cpu.std())
        os.environ.pop("ENGINE_MUL_MAT_PATH")
