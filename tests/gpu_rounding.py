"""The CPU reference with the GPU path's input roundings, for comparing whole models tightly.

The GPU multiplies q8_1-rounded activations on the MMVQ and MMQ paths (16-bit ones, q8_1 and its residual plane, on
one-column MMVQ: dispatch.residual_rows) and f16-rounded activations and weights on the dequantize+cuBLAS path, and
(unless kv_f32) keeps the KV cache in f16. The path depends on the weight's type as well as the row count (Q5_K takes
dequantize+cuBLAS from 17 rows where Q4_K still takes MMVQ): `round_like_gpu` makes CPU runtimes loaded afterwards do
the same roundings per weight, so what remains between the two is arithmetic order and rounding flips.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from engine.backends import cpu as cpu_backend
from engine.backends.base import KVCache
from engine.quants import GGMLType
from test_cuda_kernels import q8_1_ref, q16_ref


def dispatch_rounding(path: str | None):
    """(n, t, (m, k)) -> 'q8_1', 'q16' or 'f16': the rounding of an n-row mul_mat of an m x k weight of GGML type t on
    the given path (None: the path the dispatch chain chooses for that weight on this GPU; a float weight always
    multiplies f32 activations, 'f32')."""
    from engine.cuda import dispatch, mmvq
    if path == "mmq":
        return lambda n, t, shape: "q8_1"
    if path == "mmvq":
        return lambda n, t, shape: "q16" if dispatch.residual_rows(n) else "q8_1"
    if path == "dequant":
        return lambda n, t, shape: "f16"

    def chosen(n, t, shape):
        w = SimpleNamespace(quantized=True, type=t, m=shape[0], k=shape[1])
        path = dispatch.choose_path(w, n)
        if path == "mmvq":
            return "q16" if mmvq.takes_residual(int(t), n) else "q8_1"
        return "q8_1" if path == "mmq" else "f16"
    return chosen


def round_like_gpu(monkeypatch, rounding, kv_f16: bool) -> None:
    """CPU mul_mats round their inputs as rounding(n, the weight's type, its shape) says (in float64 after); float weights take
    the CPU's own product; kv_f16: an f16 KV cache."""
    types: dict[int, GGMLType] = {}                 # id of a loaded weight -> its GGML type
    weight = cpu_backend.CPUBackend.weight

    def typed_weight(self, info, data):
        w = weight(self, info, data)
        types[id(w)] = info.type
        return w

    def mul_mat(self, w, x):
        t = types[id(w)]
        if t in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
            return x @ w.T
        rounding_ = rounding(x.shape[0], t, w.shape)
        if rounding_ == "f16":
            y = x.astype(np.float16).astype(np.float64) @ w.astype(np.float16).astype(np.float64).T
        elif rounding_ == "q16":
            y = q16_ref(np.ascontiguousarray(x, dtype=np.float32))[1] @ w.astype(np.float64).T
        else:
            y = q8_1_ref(np.ascontiguousarray(x, dtype=np.float32))[1] @ w.astype(np.float64).T
        return y.astype(x.dtype)

    monkeypatch.setattr(cpu_backend.CPUBackend, "weight", typed_weight)
    monkeypatch.setattr(cpu_backend.CPUBackend, "mul_mat", mul_mat)
    if kv_f16:
        monkeypatch.setattr(cpu_backend.CPUBackend, "kv_cache",
                            lambda self, *shape: KVCache(np, *shape, np.float16))
