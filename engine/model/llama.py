"""The llama family: Llama 2/3, Mistral, SmolLM2 (GQA, RoPE on adjacent pairs with Llama 3's per-pair factors or
linear scaling when the file has them, SwiGLU, optional tied output), and the variants Qwen 2 and Qwen 3 build on
(qwen2.py, qwen3.py): RoPE on halves (neox), q/k/v biases, per-head q/k RMS norms."""
from __future__ import annotations

import math

from ..backends.base import Batch
from . import rope
from .base import Transformer


class Llama(Transformer):
    NEOX = False          # rotate halves (i, i + n_rot/2) rather than adjacent pairs
    QKV_BIAS = False      # attn_q/k/v.bias added after the projections
    QK_NORM = False       # attn_q_norm / attn_k_norm: each head RMS-normed before the rotation

    def __init__(self, gguf, backend, config, shard=None):
        super().__init__(gguf, backend, config, shard)
        c = config
        self.load_embeddings()
        self.layers = [self.load_block(il) for il in range(c.n_layer)]
        self.set_context(None)
        self.rope_mscale = c.rope_scaling.mscale                        # cos, sin times it (LongRoPE, YaRN)

    def set_context(self, n_ctx: int | None) -> None:
        c = self.cfg
        self.inv_freq = rope.inv_freq(c.n_rot, c.rope_base, c.rope_scaling,
                                      rope.freq_factors(self, c.n_rot, n_ctx))   # [n_rot / 2] f64

    def load_block(self, il: int):
        """Layer il's weights: a namespace with the attributes forward() reads."""
        c = self.cfg
        names = self.block_weight_names()
        q_dim, kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        if self.QKV_BIAS:
            names |= {"bq": ("attn_q.bias", (q_dim,)), "bk": ("attn_k.bias", (kv_dim,)),
                      "bv": ("attn_v.bias", (kv_dim,))}
        if self.QK_NORM:
            names |= {"q_norm": ("attn_q_norm.weight", (c.head_dim,)), "k_norm": ("attn_k_norm.weight", (c.head_dim,))}
        return self.layer_weights(il, names)

    def ffn(self, L, h):
        """The block's FFN on the normed residual h [n, n_embd] -> [n, n_embd] (summed over the ranks)."""
        f = self.B.glu(L.gate, L.up, h, "silu")                               # f: [n, n_ff]
        return self.B.all_reduce(self.B.mul_mat(L.down, f))

    def forward(self, batch: Batch, cache):
        B, c = self.B, self.cfg
        n = len(batch.tokens)
        x = self.embed(batch.tokens)                                       # x: [n, n_embd]
        h = B.rms_norm(x, self.layers[0].attn_norm, c.rms_eps)             # h: [n, n_embd], the normed residual
        for il, L in enumerate(self.layers):
            q, k, v = B.mul_mats((L.wq, L.wk, L.wv), h)                              # [n, q_dim], [n, kv_dim] x2
            if self.QKV_BIAS:
                q, k, v = B.add(q, L.bq), B.add(k, L.bk), B.add(v, L.bv)
            q = q.reshape(n, -1, c.head_dim)                 # q: [n, n_head, head_dim]     (n_head, n_head_kv:
            k = k.reshape(n, -1, c.head_dim)                 # k: [n, n_head_kv, head_dim]   a rank's heads under
            v = v.reshape(n, -1, c.head_dim)                 # v: [n, n_head_kv, head_dim]   tensor parallelism)
            norms = dict(q_norm=L.q_norm, k_norm=L.k_norm, eps=c.rms_eps) if self.QK_NORM else {}
            q, k = B.rope_qk(q, k, batch.positions, self.inv_freq, neox=self.NEOX, mscale=self.rope_mscale, **norms)
            a = B.attention(q, k, v, cache, il, batch, 1.0 / math.sqrt(c.head_dim), c.sliding_window)
            o = B.all_reduce(B.mul_mat(L.wo, a))                              # a: [n, n_head*head_dim], o: [n, n_embd]
            x, h = B.add_rms_norm(x, o, L.ffn_norm, c.rms_eps)
            d = self.ffn(L, h)                                                # d: [n, n_embd]
            if il + 1 < len(self.layers):                                  # the next layer's attention norm
                x, h = B.add_rms_norm(x, d, self.layers[il + 1].attn_norm, c.rms_eps)
            else:
                x = B.add(x, d)
        if len(batch.logit_rows) == 0:                                     # a ubatch that only fills the cache
            return None
        x = B.rms_norm(B.rows(x, batch.logit_rows), self.output_norm, c.rms_eps)   # x: [n_out, n_embd]
        return B.gather_vocab(B.mul_mat(self.output, x))                   # logits: [n_out, n_vocab]
