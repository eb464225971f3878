"""Teacher-forced log-prob files (llama.cpp golden format) and the fidelity metrics between two of them.

Format, little-endian: int32 n_positions, int32 k, int32 n_vocab; then per position k records of
(int32 token_id, float32 log_prob), best first. Row t is the distribution of token t+1 given tokens 0..t.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class TopK:
    ids: np.ndarray        # [n, k] int32
    logprobs: np.ndarray   # [n, k] float32
    n_vocab: int


def read_lp(path) -> TopK:
    raw = np.fromfile(path, dtype="<i4")
    if raw.size < 3:
        raise ValueError(f"{path}: not a log-prob file (too short)")
    n, k, n_vocab = (int(x) for x in raw[:3])
    if raw.size != 3 + n * k * 2:
        raise ValueError(f"{path}: size does not match its header ({n} positions x {k})")
    body = raw[3:].reshape(n, k, 2)
    return TopK(body[:, :, 0].copy(), body[:, :, 1].copy().view("<f4"), n_vocab)


def write_lp(path, top: TopK) -> None:
    n, k = top.ids.shape
    body = np.empty((n, k, 2), "<i4")
    body[:, :, 0] = top.ids
    body[:, :, 1] = top.logprobs.astype("<f4").view("<i4")
    with open(path, "wb") as f:
        np.array([n, k, top.n_vocab], "<i4").tofile(f)
        body.tofile(f)


def top_k_logprobs(logits: np.ndarray, k: int = 16) -> TopK:
    """logits [n, n_vocab] -> the k best log-probs per row (log-softmax in float64)."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    lse = np.log(np.exp(x).sum(axis=1, keepdims=True))
    idx = np.argpartition(-x, k, axis=1)[:, :k]
    vals = np.take_along_axis(x, idx, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    idx = np.take_along_axis(idx, order, axis=1)
    vals = np.take_along_axis(vals, order, axis=1) - lse
    return TopK(idx.astype(np.int32), vals.astype(np.float32), logits.shape[1])


def decode_logprobs(rt, tokens: list[int], k: int = 16, rows_per_copy: int = 64) -> TopK:
    """Teacher-forced through the decode path (a Runtime's sequence 0): token 0 alone, then one token per step at
    its position, as generation runs -> the k best log-probs of every position."""
    parts, rows = [], [rt.prefill(tokens[:1])]
    for pos, tok in enumerate(tokens[1:], 1):
        rows.append(rt.decode([0], [tok], [pos]))
        if len(rows) == rows_per_copy:
            parts.append(top_k_logprobs(np.concatenate(rows), k))
            rows = []
    if rows:
        parts.append(top_k_logprobs(np.concatenate(rows), k))
    return TopK(np.concatenate([t.ids for t in parts]), np.concatenate([t.logprobs for t in parts]), parts[0].n_vocab)


def compare(p: TopK, q: TopK) -> dict:
    """Top-1 agreement and KL(P||Q) over P's top-k; Q's k-th log-prob stands in for ids Q does not list."""
    n = min(len(p.ids), len(q.ids))
    top1 = float(np.mean(p.ids[:n, 0] == q.ids[:n, 0]))
    kl = np.empty(n)
    for t in range(n):
        qmap = dict(zip(q.ids[t].tolist(), q.logprobs[t].tolist()))
        floor = float(q.logprobs[t, -1])
        lq = np.array([qmap.get(i, floor) for i in p.ids[t].tolist()])
        lp = p.logprobs[t].astype(np.float64)
        kl[t] = np.sum(np.exp(lp) * (lp - lq))
    return {"positions": n, "top1": top1, "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99))}
