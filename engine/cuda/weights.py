"""A weight matrix on the GPU, kept in its GGUF form: raw quantized blocks, or f16/f32 values."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..quants import GGMLType, type_info


WEIGHT_PAD = 512


@dataclass
class GPUWeight:
    type: GGMLType
    m: int                 # rows (output features)
    k: int                 # columns (input features)
    data: object           # quantized: cupy uint8 [m * row_bytes]; float types: cupy f16/f32 [m, k]
    row_bytes: int

    @property
    def quantized(self) -> bool:
        return type_info(self.type).quantized

    @property
    def nbytes(self) -> int:
        return self.m * self.row_bytes


def upload(t: GGMLType, shape: tuple[int, int], raw: np.ndarray) -> GPUWeight:
    """Raw GGUF bytes of a [m, k] matrix -> GPUWeight (bf16 becomes f32; quantized blocks stay as they are)."""
    import cupy as cp

    from ..quants import dequantize

    m, k = shape
    info = type_info(t)
    raw = np.ascontiguousarray(raw).view(np.uint8)
    if t == GGMLType.F16:
        return GPUWeight(t, m, k, cp.asarray(raw.view(np.float16).reshape(m, k)), k * 2)
    if t in (GGMLType.F32, GGMLType.BF16):
        return GPUWeight(GGMLType.F32, m, k, cp.asarray(dequantize(raw, t, (m, k))), k * 4)
    row_bytes = info.row_bytes(k)
    data = cp.zeros(m * row_bytes + WEIGHT_PAD, cp.uint8)   # MMQ's 16-byte copies may read past the last row
    data[:m * row_bytes] = cp.asarray(raw.reshape(m * row_bytes))
    return GPUWeight(t, m, k, data, row_bytes)
