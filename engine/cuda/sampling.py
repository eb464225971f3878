"""Batched sampling on the device (kernels/sampling.cu): one token per row of [n, n_vocab] logits.

engine/sampling.py's Sampler is the reference and holds each row's parameters, seed and draw count; only the token
ids (n ints) and the penalties' (row, token, count) entries cross the bus.
"""
from __future__ import annotations

import numpy as np

from ..sampling import Sampler
from .build import kernel

SAMPLE_THREADS = 1024          # kernels/sampling.cu SAMPLE_THREADS
SAMPLE_PARAM_WORDS = 8         # kernels/sampling.cu SAMPLE_PARAM_WORDS
PENALTY_THREADS = 256


def pack_params(samplers: list[Sampler]) -> np.ndarray:
    """-> [n, SAMPLE_PARAM_WORDS] u32: temperature, top_k, top_p, min_p (f32 bits), seed low and high, draw counter."""
    n = len(samplers)
    words = np.zeros((n, SAMPLE_PARAM_WORDS), np.uint32)
    floats = words.view(np.float32)
    for i, s in enumerate(samplers):
        p = s.p
        floats[i, 0] = p.temperature
        words[i, 1] = max(0, min(int(p.top_k), 2 ** 31 - 1))
        floats[i, 2] = p.top_p
        floats[i, 3] = p.min_p
        words[i, 4], words[i, 5] = s.seed & 0xFFFFFFFF, s.seed >> 32
        words[i, 6] = s.draws & 0xFFFFFFFF
    return words


def penalty_entries(samplers: list[Sampler], histories: list[list[int]]):
    """-> (rows i32 [P], ids i32 [P], counts f32 [P], pen f32 [n, 3]) for the rows with penalties, or None."""
    rows, ids, counts = [], [], []
    pen = np.zeros((len(samplers), 3), np.float32)
    for i, (s, h) in enumerate(zip(samplers, histories)):
        c = s.penalty_counts(h)
        if c is None:
            continue
        pen[i] = (s.p.repeat_penalty, s.p.presence_penalty, s.p.frequency_penalty)
        rows += [i] * len(c)
        ids += list(c.keys())
        counts += list(c.values())
    if not rows:
        return None
    return np.asarray(rows, np.int32), np.asarray(ids, np.int32), np.asarray(counts, np.float32), pen


def constrain(logits, rows: np.ndarray, masks: np.ndarray | None, bias: tuple | None) -> None:
    """Backend.constrain on the device: logits [n, m] f32 (contiguous) changed in place; masks int32 [R, words] and
    the bias entries (rows, ids, values) from the host."""
    import cupy as cp

    n, m = logits.shape
    if bias is not None and len(bias[0]):
        b_rows, ids = cp.asarray(bias[0], cp.int32), cp.asarray(bias[1], cp.int32)
        values = cp.asarray(bias[2], cp.float32)
        kernel("sampling", "add_bias")((-(-len(ids) // PENALTY_THREADS),), (PENALTY_THREADS,),
                                       (logits, np.int32(m), b_rows, ids, values, np.int32(len(ids))))
    if masks is not None and len(rows):
        if masks.shape[1] * 32 < m:
            raise ValueError(f"masks of {masks.shape[1] * 32} tokens for {m} logits")
        kernel("sampling", "constrain_rows")((-(-m // PENALTY_THREADS), len(rows)), (PENALTY_THREADS,),
                                             (logits, np.int32(m), cp.asarray(rows, cp.int32),
                                              cp.asarray(masks.view(np.uint32)), np.int32(masks.shape[1])))


def sample(logits, samplers: list[Sampler], histories: list[list[int]]) -> np.ndarray:
    """logits: [n, m] f32 on the device (its rows are changed in place by penalties) -> token ids int64 [n].
    Counts one draw on each sampler."""
    import cupy as cp

    n, m = logits.shape
    if n != len(samplers):
        raise ValueError(f"{n} logit rows for {len(samplers)} samplers")
    if n == 0:
        return np.zeros(0, np.int64)
    logits = cp.ascontiguousarray(logits, dtype=cp.float32)
    pen = penalty_entries(samplers, histories)
    if pen is not None:
        if int(pen[1].max()) >= m or int(pen[1].min()) < 0:
            raise ValueError("a penalised token id is outside the vocabulary")
        rows, ids, counts, factors = (cp.asarray(a) for a in pen)
        kernel("sampling", "apply_penalties")((-(-len(rows) // PENALTY_THREADS),), (PENALTY_THREADS,),
                                              (logits, np.int32(m), rows, ids, counts, factors, np.int32(len(rows))))
    params = cp.asarray(pack_params(samplers))
    out = cp.empty(n, cp.int32)
    kernel("sampling", "sample_rows")((n,), (SAMPLE_THREADS,), (logits, np.int32(m), params, out))
    for s in samplers:
        s.draws += 1
    return out.get().astype(np.int64)
