"""The CPU reference with the GPU path's input roundings, for comparing whole models tightly.

The GPU multiplies q8_1-rounded activations on the MMVQ and MMQ paths (16-bit ones, q8_1 and its residual plane, on
one-column MMVQ: dispatch.residual_rows) and f16-rounded activations and weights on the dequantize+cuBLAS path, and (unless kv_f32) keeps the KV cache in f16. `round_like_gpu` makes CPU runtimes loaded
afterwards do the same roundings, so what remains between the two is arithmetic order and rounding flips.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from engine.backends import cpu as cpu_backend
from engine.backends.base import KVCache
from engine.quants import GGMLType
from test_cuda_kernels import q8_1_ref, q16_ref


def dispatch_rounding(path: str | None):
    """n -> 'q8_1', 'q16' or 'f16': the rounding of an n-row mul_mat of a quantized weight on the given path (None:
    the path the dispatch chooses on this GPU, taken for a Q4_K weight; the tiny models' types all share its rule)."""
    from engine.cuda import dispatch
    if path == "mmq":
        return lambda n: "q8_1"
    if path == "mmvq":
        return lambda n: "q16" if dispatch.residual_rows(n) else "q8_1"
    if path == "dequant":
        return lambda n: "f16"
    w = SimpleNamespace(quantized=True, type=GGMLType.Q4_K)

    def chosen(n):
        path = dispatch.choose_path(w, n)
        return dispatch_rounding(path)(n) if path in ("mmvq", "mmq") else "f16"
    return chosen


def round_like_gpu(monkeypatch, rounding, kv_f16: bool) -> None:
    """CPU mul_mats round their inputs as rounding(n) says (in float64 after); kv_f16: an f16 KV cache."""

    def mul_mat(self, w, x):
        if rounding(x.shape[0]) == "f16":
            y = x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).astype(np.float64).T
        elif rounding(x.shape[0]) == "q16":
            y = q16_ref(np.ascontiguousarray(x, dtype=np.float32))[1] @ w.astype(np.float64).T
        else:
            y = q8_1_ref(np.ascontiguousarray(x, dtype=np.float32))[1] @ w.astype(np.float64).T
        return y.astype(x.dtype)

    monkeypatch.setattr(cpu_backend.CPUBackend, "mul_mat", mul_mat)
    if kv_f16:
        monkeypatch.setattr(cpu_backend.CPUBackend, "kv_cache",
                            lambda self, *shape: KVCache(np, *shape, np.float16))
