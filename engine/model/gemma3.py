"""Gemma 3: scaled embeddings, Q/K RMS norms, post-attention and post-FFN norms, GELU (tanh), sliding-window layers.
Gemma 2 (gemma2.py) is this block without the Q/K norms, with capped scores and logits."""
from __future__ import annotations

import math

from ..backends.base import Batch
from . import rope
from .base import Transformer

SLIDING_ROPE_BASE = 10_000.0   # rope base of the sliding-window layers (not stored in the file)
GLOBAL_EVERY = 6               # layer il is global when il % 6 == 5


class Gemma3(Transformer):
    QK_NORM = True

    def __init__(self, gguf, backend, config, shard=None):
        super().__init__(gguf, backend, config, shard)
        c = config
        self.load_embeddings()
        extra = {
            "post_attn_norm": ("post_attention_norm.weight", (c.n_embd,)),
            "post_ffn_norm": ("post_ffw_norm.weight", (c.n_embd,)),
        }
        if self.QK_NORM:
            extra |= {"q_norm": ("attn_q_norm.weight", (c.head_dim,)), "k_norm": ("attn_k_norm.weight", (c.head_dim,))}
        self.layers = [self.layer_weights(il, {**self.block_weight_names(), **extra}) for il in range(c.n_layer)]
        self.inv_freq_sliding = rope.inv_freq(c.n_rot, SLIDING_ROPE_BASE)              # [n_rot / 2] f64
        self.inv_freq_global = rope.inv_freq(c.n_rot, c.rope_base, c.rope_scaling)      # (scaled: global layers)
        self.q_scale = 1.0 / math.sqrt(c.head_dim)
        self.attn_cap = self.final_cap = 0.0                                            # (Gemma 2's caps)

    def is_sliding(self, il: int) -> bool:
        return self.cfg.sliding_window is not None and il % GLOBAL_EVERY < GLOBAL_EVERY - 1

    def rope_of(self, il: int) -> tuple:
        """(inv_freq, mscale) of layer il's rotation."""
        if self.is_sliding(il):
            return self.inv_freq_sliding, 1.0
        return self.inv_freq_global, self.cfg.rope_scaling.mscale

    def forward(self, batch: Batch, cache):
        B, c = self.B, self.cfg
        n = len(batch.tokens)
        x = B.scale(self.embed(batch.tokens), math.sqrt(c.n_embd))               # x: [n, n_embd]
        h = B.rms_norm(x, self.layers[0].attn_norm, c.rms_eps)                    # h: [n, n_embd], normed residual
        for il, L in enumerate(self.layers):
            q, k, v = B.mul_mats((L.wq, L.wk, L.wv), h)                       # [n, q_dim], [n, kv_dim] x2
            q = q.reshape(n, -1, c.head_dim)                 # q: [n, n_head, head_dim]     (n_head, n_head_kv:
            k = k.reshape(n, -1, c.head_dim)                 # k: [n, n_head_kv, head_dim]   a rank's heads under
            v = v.reshape(n, -1, c.head_dim)                 # v: [n, n_head_kv, head_dim]   tensor parallelism)
            inv_freq, mscale = self.rope_of(il)
            norms = dict(q_norm=L.q_norm, k_norm=L.k_norm, eps=c.rms_eps) if self.QK_NORM else {}
            q, k = B.rope_qk(q, k, batch.positions, inv_freq, neox=True, mscale=mscale, **norms)
            window = c.sliding_window if self.is_sliding(il) else None
            a = B.attention(q, k, v, cache, il, batch, self.q_scale, window, self.attn_cap)   # [n, n_head*head_dim]
            o = B.all_reduce(B.mul_mat(L.wo, a))                                  # o: [n, n_embd]
            x, h = B.add_rms_norm(x, o, L.ffn_norm, c.rms_eps, r_norm=L.post_attn_norm)
            f = B.glu(L.gate, L.up, h, "gelu")                                # f: [n, n_ff]
            d = B.all_reduce(B.mul_mat(L.down, f))                                # d: [n, n_embd]
            if il + 1 < len(self.layers):                                         # the next layer's attention norm
                x, h = B.add_rms_norm(x, d, self.layers[il + 1].attn_norm, c.rms_eps, r_norm=L.post_ffn_norm)
            else:
                x = B.add(x, B.rms_norm(d, L.post_ffn_norm, c.rms_eps))
        if len(batch.logit_rows) == 0:                                     # a ubatch that only fills the cache
            return None
        x = B.rms_norm(B.rows(x, batch.logit_rows), self.output_norm, c.rms_eps)   # x: [n_out, n_embd]
        logits = B.gather_vocab(B.mul_mat(self.output, x))                        # logits: [n_out, n_vocab]
        return B.softcap(logits, self.final_cap) if self.final_cap else logits
