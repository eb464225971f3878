"""Rotary position embeddings: the frequency of each rotated pair, from the file's metadata.

    inv_freq[i] = base^(-2i / n_rot) / scale_i,   i < n_rot / 2

scale_i is 1, the linear factor (`rope.scaling.type` "linear": positions divided by it), Llama 3's per-pair factor
(the `rope_freqs.weight` tensor the converter writes from `rope_type: llama3`), or LongRoPE's (Phi-3.5, Phi-4-mini:
`rope_factors_short.weight` up to the original context, `rope_factors_long.weight` for a longer one, as llama.cpp
chooses by the context size), whose cos and sin are also multiplied by `rope.scaling.attn_factor`; YaRN (Qwen 2.5 / 3
long-context files) blends the interpolated base^(-2i/n_rot) / factor into the original frequencies over a ramp of
pairs set by the original context (beta_fast 32, beta_slow 1) and scales cos and sin by 1 + 0.1 ln(factor). The
backends rotate pair i of a head by position * inv_freq[i] (`Backend.rope`, `rope_qk`, with that mscale).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..gguf import GGUFError, GGUFFile, quoted
from ..quants import dequantize

SCALING_TYPES = ("none", "linear", "yarn", "longrope")   # longrope: its factors are tensors (freq_factors)
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0


@dataclass(frozen=True)
class RopeScaling:
    kind: str = "none"          # SCALING_TYPES
    factor: float = 1.0         # positions are divided by it ("linear")
    attn_factor: float = 1.0    # cos and sin times it (LongRoPE)
    orig_ctx: int = 0           # the pretraining context (YaRN's ramp; LongRoPE's long factors start above it)

    @property
    def mscale(self) -> float:
        """What the rotated dims' cos and sin are multiplied by."""
        if self.kind == "yarn" and self.factor > 1.0:
            return self.attn_factor * (1.0 + 0.1 * math.log(self.factor))
        return self.attn_factor

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "RopeScaling":
        kind = f.get("rope.scaling.type", "none")
        if not isinstance(kind, str):
            raise GGUFError(f"{f.path}: rope.scaling.type is not a string")
        factor = f.number("rope.scaling.factor", 1e-6, 1e6, 1.0)
        attn_factor = f.number("rope.scaling.attn_factor", 1e-6, 1e6, 1.0)
        orig_ctx = f.integer("rope.scaling.original_context_length", 0, 1 << 24, default=0)
        if kind in ("none", "") or factor == 1.0:
            return cls(attn_factor=attn_factor, orig_ctx=orig_ctx)
        if kind == "yarn" and orig_ctx == 0:
            raise GGUFError(f"{f.path}: YaRN scaling without rope.scaling.original_context_length")
        if kind not in SCALING_TYPES:
            raise GGUFError(f"{f.path}: rope scaling '{quoted(kind)}' is not supported "
                            f"(supported: {', '.join(SCALING_TYPES)})")
        return cls(kind, factor, attn_factor, orig_ctx)


def inv_freq(n_rot: int, base: float, scaling: RopeScaling = RopeScaling(),
             freq_factors: np.ndarray | None = None) -> np.ndarray:
    """[n_rot / 2] float64: the angle per position of each rotated pair."""
    f = base ** (-np.arange(n_rot // 2, dtype=np.float64) * 2.0 / n_rot)
    if scaling.kind == "linear":
        f = f / scaling.factor
    if scaling.kind == "yarn":
        def pair_of(rotations):            # the pair that turns `rotations` times over the original context
            return n_rot * math.log(scaling.orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))
        lo = max(math.floor(pair_of(YARN_BETA_FAST)), 0)
        hi = min(math.ceil(pair_of(YARN_BETA_SLOW)), n_rot - 1)
        ramp = np.clip((np.arange(n_rot // 2) - lo) / max(hi - lo, 0.001), 0.0, 1.0)
        f = f / scaling.factor * ramp + f * (1.0 - ramp)
    if freq_factors is not None:
        f = f / np.asarray(freq_factors, dtype=np.float64)
    return f


def freq_factors(model, n_rot: int, n_ctx: int | None = None) -> np.ndarray | None:
    """The file's per-pair divisors ([n_rot / 2]): `rope_freqs.weight` (Llama 3.1+), or LongRoPE's short factors
    (long ones where n_ctx is above the original context); None without them."""
    names = [name for name in ("rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight")
             if name in model.gguf.tensors]
    if not names:
        return None
    name = names[0]
    if name != "rope_freqs.weight":
        if "rope_factors_short.weight" not in names or "rope_factors_long.weight" not in names:
            raise GGUFError(f"{model.gguf.path}: LongRoPE needs both rope_factors_short and rope_factors_long")
        orig = model.cfg.rope_scaling.orig_ctx or model.cfg.n_ctx_train
        name = "rope_factors_long.weight" if n_ctx is not None and n_ctx > orig else "rope_factors_short.weight"
    info = model.gguf.tensors[name]
    if info.np_shape != (n_rot // 2,):
        raise GGUFError(f"{model.gguf.path}: {name} has shape {list(info.np_shape)}, expected [{n_rot // 2}]")
    factors = dequantize(model.gguf.tensor_data(name), info.type, info.np_shape).astype(np.float64)
    if not np.all(np.isfinite(factors)) or np.any(factors <= 0):
        raise GGUFError(f"{model.gguf.path}: {name} holds a factor that is not a positive number")
    return factors
