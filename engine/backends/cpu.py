"""The numpy backend: weights dequantized once at load, float32 arithmetic (float64 in "exact" mode).

This is the numerical reference for the GPU path. In batch-invariant mode a row's results do not depend on the other
rows of its step: each row's products go through BLAS alone, as a matrix-vector product (BLAS picks its kernel, and so
its summation order, by the row count: gemv for one, others from two and from ~19), and attention takes each query row
alone over exactly its own keys (a prompt's chunking depends on the step's budget). Measured on a 2-core CPU machine,
SmolLM2: tg128 -1.4 %, pp512 -60 % (BENCHMARKS.md, "Batch invariance").
"""
from __future__ import annotations

import math

import numpy as np

from ..gguf import TensorInfo
from ..quants import dequantize
from .base import Q8_0_GROUP, Backend, Batch, KVCache, block_positions, check_q8_0_head_dim


def quantize_q8_0(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x [..., d] (d a multiple of 32) -> (int8 [..., d], f16 scales [..., d // 32]): GGML's q8_0 rounding (scale
    max|x| / 127, values rounded half away from zero with the f32 scale, the scale stored as f16)."""
    g = x.astype(np.float32).reshape(*x.shape[:-1], -1, Q8_0_GROUP)
    scale = np.abs(g).max(axis=-1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale != 0)
    y = g * inv
    q = np.trunc(y + np.copysign(np.float32(0.5), y)).astype(np.int8)
    return q.reshape(x.shape), scale[..., 0].astype(np.float16)


def dequantize_q8_0(q: np.ndarray, scale: np.ndarray, dtype) -> np.ndarray:
    """(int8 [..., d], f16 [..., d // 32]) -> [..., d] of dtype."""
    g = q.reshape(*q.shape[:-1], -1, Q8_0_GROUP).astype(dtype) * scale[..., None].astype(dtype)
    return g.reshape(q.shape)


class Q8KVCache(KVCache):
    """Keys and values in GGML's q8_0 blocks (llama.cpp's -ctk/-ctv q8_0): int8 values [n_blocks, block_size,
    n_head_kv, head_dim] and f16 scales [n_blocks, block_size, n_head_kv, head_dim // 32] per layer."""

    def __init__(self, n_layer, n_blocks, block_size, n_head_kv, head_dim):
        check_q8_0_head_dim(head_dim)
        super().__init__(np, n_layer, n_blocks, block_size, n_head_kv, head_dim, np.int8)
        shape = (n_layer, n_blocks, block_size, n_head_kv, head_dim // Q8_0_GROUP)
        self.k_scale_layers = np.zeros(shape, np.float16)      # [n_layer, n_blocks, block_size, n_head_kv, groups]
        self.v_scale_layers = np.zeros(shape, np.float16)
        self.k_scale, self.v_scale = list(self.k_scale_layers), list(self.v_scale_layers)

    def copy_prefix(self, src, dst, n):
        super().copy_prefix(src, dst, n)
        self.k_scale_layers[:, dst, :n] = self.k_scale_layers[:, src, :n]
        self.v_scale_layers[:, dst, :n] = self.v_scale_layers[:, src, :n]

    def store(self, layer, blocks, offsets, k, v):
        for values, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = quantize_q8_0(x)
            values[layer][blocks, offsets] = q
            scales[layer][blocks, offsets] = s

    def read(self, layer, table, lo, hi, dtype):
        return tuple(dequantize_q8_0(block_positions(values[layer], table, lo, hi),
                                     block_positions(scales[layer], table, lo, hi), dtype)
                     for values, scales in ((self.k, self.k_scale), (self.v, self.v_scale)))


def _fault_in(cache: KVCache) -> None:
    """Write every page of a new cache now, as llama.cpp clears its KV buffer: numpy's zeros leave each (2 MB huge)
    page to be faulted in by the step that first writes it, and a request whose prefix lands in fresh blocks paid
    ~17 ms of page faults (SmolLM2; a burst of 32, 275 ms)."""
    for name, array in vars(cache).items():
        if name.endswith("_layers"):              # k_layers, v_layers (and a q8_0 cache's scales)
            array.fill(0)


class CPUBackend(Backend):
    name = "cpu"
    supports_moe = True
    paged_kv = True
    kv_types = ("f16", "q8_0")

    def __init__(self, exact: bool = False, batch_invariant: bool = False):
        self.exact = exact
        self.batch_invariant = batch_invariant
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
        if not self.batch_invariant:
            return x @ w.T                                              # [n, k] @ [k, m] -> [n, m]
        out = np.empty((len(x), len(w)), np.result_type(x, w))         # [n, m]
        for i, row in enumerate(x):                                     # one BLAS gemv a row
            out[i] = w @ row
        return out

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

    def kv_cache(self, n_layer, n_blocks, block_size, n_head_kv, head_dim, kv_type=None):
        if kv_type == "q8_0":
            cache = Q8KVCache(n_layer, n_blocks, block_size, n_head_kv, head_dim)
        else:
            dtype = np.float16 if kv_type == "f16" else self.dtype
            cache = KVCache(np, n_layer, n_blocks, block_size, n_head_kv, head_dim, dtype)
        _fault_in(cache)
        return cache

    def attention(self, q, k, v, cache, layer, batch: Batch, scale, window, softcap=0.0):
        n, n_head, d = q.shape
        out = np.empty((n, n_head, d), self.dtype)
        bs = cache.block_size
        for r, (seq, a, b) in enumerate(batch.seq_ranges):
            table = batch.block_tables[r] if batch.block_tables is not None else np.array([seq])   # its blocks
            pos = batch.positions[a:b]                              # [nq]
            cache.store(layer, table[pos // bs], pos % bs, k[a:b], v[a:b])
            hi = int(pos.max()) + 1
            lo = max(0, int(pos.min()) - window + 1) if window else 0
            keys, vals = cache.read(layer, table, lo, hi, self.dtype)           # [L, n_kv, d] x2
            if not self.batch_invariant:
                out[a:b] = self._attend(q[a:b], pos, keys, vals, lo, scale, window, softcap)
                continue
            for i, p in enumerate(pos.tolist()):                    # each query alone over keys lo_i..p
                lo_i = max(0, p - window + 1) if window else 0
                # contiguous whether the cache gave a view of consecutive blocks or a gathered copy
                keys_i = np.ascontiguousarray(keys[lo_i - lo:p + 1 - lo])
                vals_i = np.ascontiguousarray(vals[lo_i - lo:p + 1 - lo])
                out[a + i:a + i + 1] = self._attend(q[a + i:a + i + 1], pos[i:i + 1], keys_i, vals_i, lo_i, scale,
                                                    window, softcap)
        return out.reshape(n, n_head * d)

    def _attend(self, q, pos, keys, vals, lo, scale, window, softcap):
        """Causal GQA attention of queries q [nq, n_head, d] at positions pos over keys / vals [L, n_kv, d] of
        positions lo.. -> [nq, n_head, d]."""
        nq, n_head, d = q.shape
        n_kv = keys.shape[1]
        group = n_head // n_kv
        keys = keys.transpose(1, 2, 0)                              # [n_kv, d, L]
        vals = vals.transpose(1, 0, 2)                              # [n_kv, L, d]
        qs = q.reshape(nq, n_kv, group, d).transpose(1, 2, 0, 3)    # [n_kv, group, nq, d]
        scores = (qs @ keys[:, None]) * scale                       # [n_kv, group, nq, L]
        if softcap:
            scores = softcap * np.tanh(scores / softcap)
        kpos = np.arange(lo, lo + keys.shape[2])
        masked = kpos[None, :] > pos[:, None]                       # [nq, L]: future keys
        if window:
            masked |= kpos[None, :] <= pos[:, None] - window
        scores[..., masked] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        probs = np.exp(scores)
        probs /= probs.sum(axis=-1, keepdims=True)
        o = probs @ vals[:, None]                                   # [n_kv, group, nq, d]
        return o.transpose(2, 0, 1, 3).reshape(nq, n_head, d)

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
