"""The mul_mat chain: y = x W^T, choosing MMVF / MMVQ / MMQ / dequantize+cuBLAS by type, columns and architecture.

    float weights, n <= 8          -> MMVF
    float weights, n > 8           -> cuBLAS
    quantized, n <= mmvq_max(T)    -> MMVQ (weights read once for all columns)
    quantized, n >= mmq_min(T)     -> MMQ (int8 tensor cores)
    otherwise                      -> dequantize to f16 + cuBLAS

Force a path for tests and benchmarks with `mul_mat(..., path=...)` or ENGINE_MUL_MAT_PATH=mmvq|mmq|dequant.
"""
from __future__ import annotations

import os

from . import launch
from .build import QTYPES
from .weights import GPUWeight

# Per compute capability: the largest column count MMVQ takes, and the smallest MMQ takes (per type; None = never).
# From `scripts/bench_kernels.py --compare` on the H200 (BENCHMARKS.md): at every n from 16 to 512 and every type,
# dequantize+cuBLAS beat our MMQ by 2-5x, so sm_90 takes that path above 8 columns until MMQ improves.
THRESHOLDS = {
    (9, 0): {"mmvq_max": {}, "mmvq_default": 8, "mmq_min": {}, "mmq_default": None},
}
DEFAULT_ARCH = (9, 0)
PATHS = ("mmvf", "cublas", "mmvq", "mmq", "dequant")
SUPPORTED_QTYPES = frozenset(QTYPES.values())


def _arch() -> tuple[int, int]:
    import cupy
    cc = cupy.cuda.Device().compute_capability
    return int(cc[:-1]), int(cc[-1])


def choose_path(w: GPUWeight, n: int, arch: tuple[int, int] | None = None) -> str:
    if not w.quantized:
        return "mmvf" if n <= 8 else "cublas"
    if int(w.type) not in SUPPORTED_QTYPES:
        return "dequant"
    table = THRESHOLDS.get(arch or _arch(), THRESHOLDS[DEFAULT_ARCH])
    if n <= table["mmvq_max"].get(int(w.type), table["mmvq_default"]):
        return "mmvq"
    mmq_min = table["mmq_min"].get(int(w.type), table["mmq_default"])
    return "mmq" if mmq_min is not None and n >= mmq_min else "dequant"


def mul_mat(w: GPUWeight, x, path: str | None = None, out=None):
    """x: [n, k] f32 -> [n, m] f32."""
    n = x.shape[0]
    if n == 0:
        import cupy
        return cupy.empty((0, w.m), cupy.float32)
    path = path or os.environ.get("ENGINE_MUL_MAT_PATH") or choose_path(w, n)
    if path == "mmvq" and n > 8:
        raise ValueError("MMVQ takes at most 8 columns")
    if path in ("mmvq", "mmq") and not w.quantized:
        path = "mmvf" if n <= 8 else "cublas"
    if path == "mmvf":
        return launch.mmvf(w, x, out)
    if path == "cublas":
        return launch.gemm_xwt(x, w.data, out)
    if path == "mmvq":
        qs, ds = launch.quantize_q8_1(x)
        return launch.mmvq(w, qs, ds, n, out)
    if path == "mmq":
        n_pad = (n + launch.MMQ_BN - 1) // launch.MMQ_BN * launch.MMQ_BN
        qs, ds = launch.quantize_q8_1(x, n_pad)
        return launch.mmq(w, qs, ds, n, out)
    if path == "dequant":
        return launch.gemm_xwt(x, launch.dequantize(w, "f16"), out)
    raise ValueError(f"unknown mul_mat path {path!r} (one of {', '.join(PATHS)})")
