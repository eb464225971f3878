"""Rotary position embeddings: the frequency of each rotated pair, from the file's metadata.

    inv_freq[i] = base^(-2i / n_rot) / scale_i,   i < n_rot / 2

scale_i is 1, the linear factor (`rope.scaling.type` "linear": positions divided by it), or Llama 3's per-pair factor
(the `rope_freqs.weight` tensor the converter writes from `rope_type: llama3`). The backends rotate pair i of a head
by position * inv_freq[i] (`Backend.rope`, `rope_qk`), so every variant is only this array.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..gguf import GGUFError, GGUFFile, quoted

SCALING_TYPES = ("none", "linear")


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"          # "none" or "linear" (yarn and longrope: refused with a clear error)
    factor: float = 1.0         # positions are divided by it ("linear")

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "RopeScaling":
        kind = f.get("rope.scaling.type", "none")
        if not isinstance(kind, str):
            raise GGUFError(f"{f.path}: rope.scaling.type is not a string")
        factor = f.number("rope.scaling.factor", 1e-6, 1e6, 1.0)
        if kind in ("none", "") or factor == 1.0:
            return cls()
        if kind not in SCALING_TYPES:
            raise GGUFError(f"{f.path}: rope scaling '{quoted(kind)}' is not supported "
                            f"(supported: {', '.join(SCALING_TYPES)})")
        return cls(kind, factor)


def inv_freq(n_rot: int, base: float, scaling: RopeScaling = RopeScaling(),
             freq_factors: np.ndarray | None = None) -> np.ndarray:
    """[n_rot / 2] float64: the angle per position of each rotated pair."""
    f = base ** (-np.arange(n_rot // 2, dtype=np.float64) * 2.0 / n_rot)
    if scaling.kind == "linear":
        f = f / scaling.factor
    if freq_factors is not None:
        f = f / np.asarray(freq_factors, dtype=np.float64)
    return f


def freq_factors(model, n_rot: int) -> np.ndarray | None:
    """The file's `rope_freqs.weight` ([n_rot / 2] per-pair divisors, Llama 3.1+), or None."""
    if "rope_factors_long.weight" in model.gguf.tensors or "rope_factors_short.weight" in model.gguf.tensors:
        raise GGUFError(f"{model.gguf.path}: LongRoPE scaling (rope_factors_long / rope_factors_short) is not "
                        f"supported (supported: {', '.join(SCALING_TYPES)}, and Llama 3's rope_freqs)")
    info = model.gguf.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    if info.np_shape != (n_rot // 2,):
        raise GGUFError(f"{model.gguf.path}: rope_freqs.weight has shape {list(info.np_shape)}, expected [{n_rot // 2}]")
    from ..quants import dequantize
    factors = dequantize(model.gguf.tensor_data("rope_freqs.weight"), info.type, info.np_shape).astype(np.float64)
    if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise GGUFError(f"{model.gguf.path}: rope_freqs.weight holds a factor that is not a positive number")
    return factors
