#!/usr/bin/env python3
"""Which mul_mats' activation rounding the decode path's KL comes from, emulated on the CPU.

    python scripts/rounding_roles.py smol|gemma [CONFIG ...]
A CONFIG is a JSON object {role: rounding}: role one of attn_in (q, k, v), wo_in (attention output), ffn_in (gate,
up), down_in (the GLU's output) and head_in (the output matrix); rounding "q8_1" (the GPU's default one-column MMVQ
activations) or "q16" (q8_1 and its residual plane, `--decode-activations q16`); roles not named stay exact. Default:
all roles q8_1, then each role alone. For each: the exact float64 CPU path with those roundings, teacher-forced over
the Apache text in 512-token ubatches, against the exact path's recorded log-probs (tests/data/exact): KL and top-1,
as `scripts/fidelity.py` reports them.
"""
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from conftest import MODEL_KEYS  # noqa: E402
from engine import hub  # noqa: E402
from engine.backends import cpu as cpu_backend  # noqa: E402
from engine.logprobs import compare, read_lp, top_k_logprobs  # noqa: E402
from engine.runtime import Runtime  # noqa: E402
from test_cuda_kernels import q8_1_ref, q16_ref  # noqa: E402

ROLES = {"attn_q": "attn_in", "attn_k": "attn_in", "attn_v": "attn_in", "attn_qkv": "attn_in",
         "attn_output": "wo_in", "ffn_gate": "ffn_in", "ffn_up": "ffn_in", "ffn_up_gate": "ffn_in",
         "ffn_down": "down_in", "output": "head_in", "token_embd": "head_in"}
ROUND = {"q8_1": q8_1_ref, "q16": q16_ref}


def role_rounding(config: dict) -> None:
    """CPU mul_mats of quantized weights round their activations as config says for the weight's role."""
    roles: dict[int, str] = {}                          # id of a loaded quantized weight -> its role
    weight = cpu_backend.CPUBackend.weight

    def named_weight(self, info, data):
        w = weight(self, info, data)
        if info.type.name not in ("F32", "F16", "BF16"):
            parts = info.name.split(".")
            roles[id(w)] = ROLES.get(parts[-2] if parts[0] == "blk" else parts[0], "other")
        return w

    def mul_mat(self, w, x):
        rounding = config.get(roles.get(id(w)))
        if rounding is None:
            return x @ w.T
        xr = ROUND[rounding](np.ascontiguousarray(x, dtype=np.float32))[1]
        return (xr @ w.astype(np.float64).T).astype(x.dtype)

    cpu_backend.CPUBackend.weight = named_weight
    cpu_backend.CPUBackend.mul_mat = mul_mat


def main(argv) -> None:
    key = argv[0]
    names = ("attn_in", "wo_in", "ffn_in", "down_in", "head_in")
    configs = [json.loads(c) for c in argv[1:]] or [dict.fromkeys(names, "q8_1")] + [{r: "q8_1"} for r in names]
    config: dict = {}
    role_rounding(config)
    tokens = [int(t) for t in (ROOT / f"tests/data/llamacpp/apache.{key}.tokens").read_text().split()]
    ref = read_lp(str(ROOT / f"tests/data/exact/apache.{key}.exact.lp16.bin"))
    rt = Runtime.load(str(hub.fetch(MODEL_KEYS[key])), device="cpu", exact=True, n_ctx=max(len(tokens), 512),
                      n_ubatch=512)
    for c in configs:
        config.clear()
        config.update(c)
        t0 = time.time()
        r = compare(top_k_logprobs(rt.prefill(tokens, all_logits=True), 16), ref)
        print(f"{key} {json.dumps(c)}: KL {r['kl_mean']:.6f}, top-1 {r['top1']:.4f} ({time.time() - t0:.0f} s)",
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
