"""The one table of GGML types: block size, bytes per block, numpy dequantization to float32.

Every block layout the host side knows lives here; the CUDA kernels are tested against these functions.
The arithmetic follows ggml's reference dequantizers operation for operation, so results are bit-exact.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Callable

import numpy as np

QK_K = 256  # super-block size of the k-quants


class GGMLType(IntEnum):
    """GGML tensor type ids as stored in GGUF files (all ids ggml defines, supported or not)."""
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39


# ---------------------------------------------------------------------------------------------------------------
# helpers: fields of a block array  blocks: [n_blocks, type_size] uint8
# ---------------------------------------------------------------------------------------------------------------

def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The f16 at byte `start` of each block, as float32: [n_blocks, 1]."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, m] packed bytes -> [n, 2, m] (low nibbles, then high nibbles)."""
    return np.stack([qs & 0x0F, qs >> 4], axis=1)


def _bits(packed: np.ndarray, n_bits: int) -> np.ndarray:
    """[n, m] bytes -> [n, n_bits, m]: bit b of every byte (little-endian bit order)."""
    shifts = np.arange(n_bits, dtype=np.uint8).reshape(1, n_bits, 1)
    return (packed[:, None, :] >> shifts) & 1


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs packed in 12 bytes of Q4_K/Q5_K: [n, 12] -> two [n, 8] uint8."""
    s = scales
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc, mn


# ---------------------------------------------------------------------------------------------------------------
# dequantizers: blocks [n_blocks, type_size] uint8 -> [n_blocks, block_size] float32
# ---------------------------------------------------------------------------------------------------------------

def _deq_f32(b):
    return b.copy().view(np.float32)


def _deq_f16(b):
    return b.copy().view(np.float16).astype(np.float32)


def _deq_bf16(b):
    return (b.copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _deq_q4_0(b):
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18]).reshape(-1, 32).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _deq_q4_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20]).reshape(-1, 32).astype(np.float32)
    return d * q + m


def _q5_values(qh_bytes: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """5-bit values 0..31 of Q5_0/Q5_1: qh [n, 4] bytes (bit j = high bit of value j), qs [n, 16]."""
    high = _bits(qh_bytes, 8).transpose(0, 2, 1).reshape(-1, 32)  # value j <- bit j%8 of byte j//8
    return _nibbles(qs).reshape(-1, 32) | (high << 4)


def _deq_q5_0(b):
    d = _f16(b, 0)
    q = _q5_values(b[:, 2:6], b[:, 6:22]).astype(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _deq_q5_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    q = _q5_values(b[:, 4:8], b[:, 8:24]).astype(np.float32)
    return d * q + m


def _deq_q8_0(b):
    d = _f16(b, 0)
    return b[:, 2:34].view(np.int8).astype(np.float32) * d


def _deq_q2_k(b):
    n = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).astype(np.float32)).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).astype(np.float32)).reshape(n, 16, 1)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = (qs.reshape(n, 2, 1, 32) >> shifts) & 3  # [n, half, shift, 32]
    q = q.reshape(n, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q3_k(b):
    n = b.shape[0]
    hmask, qs, packed = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    low = np.stack([packed[:, 0:8] & 0x0F, packed[:, 0:8] >> 4], axis=1).reshape(n, 16)
    high = (packed[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)) & 3
    sc = (low | (high.reshape(n, 16) << 4)).astype(np.int8) - np.int8(32)
    dl = (d * sc.astype(np.float32)).reshape(n, 16, 1)
    shifts = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = ((qs.reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32).astype(np.int8)
    h = _bits(hmask, 8)  # [n, 8, 32]: bit j of hmask[l] is the high bit of value 32*j + l
    q = q - np.where(h == 0, np.int8(4), np.int8(0))
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


def _deq_q4_k(b):
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:144].reshape(n * 4, 32)).reshape(n, 8, 32).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q5_k(b):
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:176]
    dl = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    ml = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    low = _nibbles(qs.reshape(n * 4, 32)).reshape(n, 8, 32)
    q = (low | (_bits(qh, 8) << 4)).astype(np.float32)
    return (dl * q - ml).reshape(n, QK_K)


def _deq_q6_k(b):
    n = b.shape[0]
    ql, qh, scales = b[:, 0:128], b[:, 128:192], b[:, 192:208]
    d = _f16(b, 208)
    dl = (d * scales.view(np.int8).astype(np.float32)).reshape(n, 16, 1)
    low = _nibbles(ql.reshape(n * 2, 64)).reshape(n, 2, 2, 2, 32)  # [n, half, nibble, j, 32]
    high = ((qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3)
    high = high.reshape(n, 2, 2, 2, 32)  # [n, half, shift//4, (shift//2)%2, 32]
    # value index within a half: 32*(2*nibble + j) + l, high bits shift = 2*(2*nibble + j)
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return (dl * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _deq_iq4_nl(b):
    d = _f16(b, 0)
    q = IQ4_NL_VALUES[_nibbles(b[:, 2:18]).reshape(-1, 32)]
    return d * q.astype(np.float32)


def _deq_iq4_xs(b):
    n = b.shape[0]
    d = _f16(b, 0)
    scales_h = b[:, 2:4].copy().view(np.uint16).astype(np.uint32)  # [n, 1]
    scales_l = b[:, 4:8]
    ib = np.arange(8)
    low = (scales_l[:, ib // 2] >> (4 * (ib % 2)).astype(np.uint8)) & 0x0F
    high = (scales_h >> (2 * ib).astype(np.uint32)) & 3
    ls = (low.astype(np.int32) | (high.astype(np.int32) << 4)) - 32
    dl = (d * ls.astype(np.float32)).reshape(n, 8, 1)
    q = IQ4_NL_VALUES[_nibbles(b[:, 8:136].reshape(n * 8, 16)).reshape(n, 8, 32)]
    return (dl * q.astype(np.float32)).reshape(n, QK_K)


# ---------------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TypeInfo:
    type: GGMLType
    block_size: int                     # elements per block
    type_size: int                      # bytes per block
    dequantize_blocks: Callable[[np.ndarray], np.ndarray]

    @property
    def quantized(self) -> bool:
        return self.block_size > 1

    def row_bytes(self, n_elements: int) -> int:
        return n_elements // self.block_size * self.type_size


TYPES: dict[GGMLType, TypeInfo] = {t.type: t for t in [
    TypeInfo(GGMLType.F32, 1, 4, _deq_f32),
    TypeInfo(GGMLType.F16, 1, 2, _deq_f16),
    TypeInfo(GGMLType.BF16, 1, 2, _deq_bf16),
    TypeInfo(GGMLType.Q4_0, 32, 18, _deq_q4_0),
    TypeInfo(GGMLType.Q4_1, 32, 20, _deq_q4_1),
    TypeInfo(GGMLType.Q5_0, 32, 22, _deq_q5_0),
    TypeInfo(GGMLType.Q5_1, 32, 24, _deq_q5_1),
    TypeInfo(GGMLType.Q8_0, 32, 34, _deq_q8_0),
    TypeInfo(GGMLType.Q2_K, QK_K, 84, _deq_q2_k),
    TypeInfo(GGMLType.Q3_K, QK_K, 110, _deq_q3_k),
    TypeInfo(GGMLType.Q4_K, QK_K, 144, _deq_q4_k),
    TypeInfo(GGMLType.Q5_K, QK_K, 176, _deq_q5_k),
    TypeInfo(GGMLType.Q6_K, QK_K, 210, _deq_q6_k),
    TypeInfo(GGMLType.IQ4_NL, 32, 18, _deq_iq4_nl),
    TypeInfo(GGMLType.IQ4_XS, QK_K, 136, _deq_iq4_xs),
]}

# Sizes of the types ggml defines that the engine cannot compute with; used only to validate a file's layout.
OTHER_TYPE_SIZES: dict[GGMLType, tuple[int, int]] = {
    GGMLType.Q8_1: (32, 36), GGMLType.Q8_K: (256, 292), GGMLType.IQ2_XXS: (256, 66), GGMLType.IQ2_XS: (256, 74),
    GGMLType.IQ3_XXS: (256, 98), GGMLType.IQ1_S: (256, 50), GGMLType.IQ3_S: (256, 110), GGMLType.IQ2_S: (256, 82),
    GGMLType.I8: (1, 1), GGMLType.I16: (1, 2), GGMLType.I32: (1, 4), GGMLType.I64: (1, 8), GGMLType.F64: (1, 8),
    GGMLType.IQ1_M: (256, 56), GGMLType.TQ1_0: (256, 54), GGMLType.TQ2_0: (256, 66), GGMLType.MXFP4: (32, 17),
}


class UnsupportedTypeError(ValueError):
    pass


def block_layout(t: GGMLType) -> tuple[int, int]:
    """(elements per block, bytes per block) of any type ggml defines."""
    if t in TYPES:
        return TYPES[t].block_size, TYPES[t].type_size
    return OTHER_TYPE_SIZES[t]


def type_info(t: GGMLType | int) -> TypeInfo:
    t = GGMLType(t)
    if t not in TYPES:
        raise UnsupportedTypeError(f"tensor type {t.name} is not supported (supported: "
                                   f"{', '.join(x.name for x in TYPES)})")
    return TYPES[t]


def dequantize(data: np.ndarray, t: GGMLType | int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw bytes of a tensor -> float32 array of `shape` given in numpy order (slowest dimension first)."""
    info = type_info(t)
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(-1, info.type_size)
    return info.dequantize_blocks(raw).reshape(shape)


# byte offsets of each quantized type's f16 scale fields (filled with finite values by random_blocks)
F16_FIELDS = {
    GGMLType.Q4_0: [0], GGMLType.Q4_1: [0, 2], GGMLType.Q5_0: [0], GGMLType.Q5_1: [0, 2], GGMLType.Q8_0: [0],
    GGMLType.Q2_K: [80, 82], GGMLType.Q3_K: [108], GGMLType.Q4_K: [0, 2], GGMLType.Q5_K: [0, 2],
    GGMLType.Q6_K: [208], GGMLType.IQ4_NL: [0], GGMLType.IQ4_XS: [0],
}


def random_blocks(t: GGMLType, n_blocks: int, rng) -> np.ndarray:
    """Random blocks of type t: [n_blocks, type_size] uint8, scale fields finite f16 values (for tests and benchmarks)."""
    info = TYPES[t]
    if not info.quantized:
        vals = rng.standard_normal(n_blocks).astype({GGMLType.F32: np.float32, GGMLType.F16: np.float16}.get(t, np.float32))
        if t == GGMLType.BF16:
            return (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
        return vals.view(np.uint8).reshape(n_blocks, info.type_size)
    blocks = rng.integers(0, 256, size=(n_blocks, info.type_size), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        blocks[:, off:off + 2] = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks
