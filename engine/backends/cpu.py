"""The numpy backend: weights dequantized once at load, float32 arithmetic (float64 in "exact" mode).

This is the numerical reference for the GPU path.
"""
from __future__ import annotations

import math

import numpy as np

from ..gguf import TensorInfo
from ..quants import dequantize
from .base import Backend, Batch, KVCache


class CPUBackend(Backend):
    name = "cpu"
    supports_moe = True
    paged_kv = True

    def __init__(self, exact: bool = False):
        self.exact = exact
        self.dtype = np.float64 if exact else np.float32

    def weight(self, info: TensorInfo, data: np.ndarray) -> np.ndarray:
        return dequantize(data, info.type, info.np_shape).astype(self.dtype, copy=False)

    def embed(self, table, tokens, first=None):
        if first is None:
            return table[tokens]                                        # [n, n_embd]
        local = tokens - first
        ours = (local >= 0) & (local < len(table))
        return table[np.where(ours, local, 0)] * ours[:, None]

    def mul_mat(self, w, x):
        return x @ w.T                                                  # [n, k] @ [k, m] -> [n, m]

    def moe(self, router, gates, ups, downs, x, k, act, norm=True, shared=None):
        logits = self.mul_mat(router, x)                                # [n, n_expert]
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        top = np.argsort(-p, axis=1, kind="stable")[:, :k]                # [n, k]: the chosen experts, best first
        w = np.take_along_axis(p, top, axis=1)
        if norm:
            w /= w.sum(axis=1, keepdims=True)
        out = np.zeros_like(x)
        if shared is not None:
            gate_inp, gate, up, down = shared
            out += self.mul_mat(down, self.glu(gate, up, x, act)) / (1.0 + np.exp(-(x @ gate_inp)))[:, None]
        for e in np.unique(top):
            rows, j = np.nonzero(top == e)
            y = self.mul_mat(downs[e], self.glu(gates[e], ups[e], x[rows], act))
            out[rows] += w[rows, j][:, None] * y
        return out

    def rms_norm(self, x, w, eps):
        ms = np.mean(np.square(x), axis=-1, keepdims=True)
        return (x / np.sqrt(ms + eps)) * w

    def rope(self, x, positions, inv_freq, neox, mscale=1.0):
        half = len(inv_freq)
        n_rot = 2 * half
        angle = positions.astype(np.float64)[:, None] * inv_freq[None, :]           # [n, half]
        cos = (np.cos(angle) * mscale).astype(self.dtype)[:, None, :]               # [n, 1, half]
        sin = (np.sin(angle) * mscale).astype(self.dtype)[:, None, :]
        out = x.copy()
        if neox:
            a, b = x[..., :half], x[..., half:n_rot]
            out[..., :half] = a * cos - b * sin
            out[..., half:n_rot] = a * sin + b * cos
        else:
            a, b = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
            out[..., 0:n_rot:2] = a * cos - b * sin
            out[..., 1:n_rot:2] = a * sin + b * cos
        return out

    @property
    def kv_dtype(self):
        return self.dtype

    def kv_cache(self, n_layer, n_blocks, block_size, n_head_kv, head_dim):
        return KVCache(np, n_layer, n_blocks, block_size, n_head_kv, head_dim, self.dtype)

    def attention(self, q, k, v, cache, layer, batch: Batch, scale, window, softcap=0.0):
        n, n_head, d = q.shape
        n_kv = k.shape[1]
        group = n_head // n_kv
        kc, vc = cache.k[layer], cache.v[layer]                     # [n_blocks, block_size, n_kv, d]
        bs = kc.shape[1]
        out = np.empty((n, n_head, d), self.dtype)
        for r, (seq, a, b) in enumerate(batch.seq_ranges):
            table = batch.block_tables[r] if batch.block_tables is not None else np.array([seq])   # its blocks
            pos = batch.positions[a:b]                              # [nq]
            kc[table[pos // bs], pos % bs] = k[a:b]
            vc[table[pos // bs], pos % bs] = v[a:b]
            hi = int(pos.max()) + 1
            lo = max(0, int(pos.min()) - window + 1) if window else 0
            keys, vals = (self._positions(c, table, lo, hi) for c in (kc, vc))     # [L, n_kv, d]
            keys = keys.transpose(1, 2, 0)                          # [n_kv, d, L]
            vals = vals.transpose(1, 0, 2)                          # [n_kv, L, d]
            qs = q[a:b].reshape(b - a, n_kv, group, d).transpose(1, 2, 0, 3)   # [n_kv, group, nq, d]
            scores = (qs @ keys[:, None]) * scale                   # [n_kv, group, nq, L]
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            kpos = np.arange(lo, hi)
            masked = kpos[None, :] > pos[:, None]                   # [nq, L]: future keys
            if window:
                masked |= kpos[None, :] <= pos[:, None] - window
            scores[..., masked] = -np.inf
            scores -= scores.max(axis=-1, keepdims=True)
            probs = np.exp(scores)
            probs /= probs.sum(axis=-1, keepdims=True)
            o = probs @ vals[:, None]                               # [n_kv, group, nq, d]
            out[a:b] = o.transpose(2, 0, 1, 3).reshape(b - a, n_head, d)
        return out.reshape(n, n_head * d)

    @staticmethod
    def _positions(cache, table, lo: int, hi: int):
        """Positions lo..hi-1 of the sequence whose blocks are table: [hi - lo, n_kv, d] (a view within one block)."""
        bs = cache.shape[1]
        j0, j1 = lo // bs, (hi - 1) // bs + 1
        if j1 - j0 == 1:
            return cache[table[j0], lo - j0 * bs:hi - j0 * bs]
        return cache[table[j0:j1]].reshape(-1, *cache.shape[2:])[lo - j0 * bs:hi - j0 * bs]

    def swiglu(self, gate, up):
        return gate / (1.0 + np.exp(-gate)) * up

    def geglu(self, gate, up):
        c = math.sqrt(2.0 / math.pi)  # a python float: keeps float32 arrays float32
        return 0.5 * gate * (1.0 + np.tanh(c * (gate + 0.044715 * gate ** 3))) * up

    def add(self, a, b):
        return a + b

    def softcap(self, x, cap):
        return cap * np.tanh(x / cap)

    def scale(self, x, s):
        return x * s

    def rows(self, x, idx):
        return x[idx]

    def to_numpy(self, x):
        return np.asarray(x, dtype=np.float32)
