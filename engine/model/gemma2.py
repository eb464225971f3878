"""Gemma 2: Gemma 3's block without the q/k norms, with capped attention scores (attn_logit_softcapping) and final
logits (final_logit_softcapping), and a sliding window on every other layer (the even ones)."""
from __future__ import annotations

import math

from ..backends.base import Batch
from . import rope
from .base import Transformer


class Gemma2(Transformer):
    def __init__(self, gguf, backend, config):
        super().__init__(gguf, backend, config)
        c = config
        self.attn_cap = gguf.number("attn_logit_softcapping", 0.0, 1e6, 50.0)
        self.final_cap = gguf.number("final_logit_softcapping", 0.0, 1e6, 30.0)
        self.load_embeddings()
        extra = {"post_attn_norm": ("post_attention_norm.weight", (c.n_embd,)),
                 "post_ffn_norm": ("post_ffw_norm.weight", (c.n_embd,))}
        self.layers = [self.layer_weights(il, {**self.block_weight_names(), **extra}) for il in range(c.n_layer)]
        self.inv_freq = rope.inv_freq(c.n_rot, c.rope_base, c.rope_scaling)        # [n_rot / 2] f64
        # queries scaled by 1/sqrt(head_dim), as llama.cpp does, except the 27B (46 layers): 1/sqrt(n_embd / n_head)
        self.q_scale = 1.0 / math.sqrt(c.n_embd // c.n_head if c.n_layer == 46 else c.head_dim)

    def forward(self, batch: Batch, cache):
        B, c = self.B, self.cfg
        n = len(batch.tokens)
        x = B.scale(B.embed(self.tok_embd, batch.tokens), math.sqrt(c.n_embd))   # x: [n, n_embd]
        h = B.rms_norm(x, self.layers[0].attn_norm, c.rms_eps)                    # h: [n, n_embd], normed residual
        for il, L in enumerate(self.layers):
            q, k, v = B.mul_mats((L.wq, L.wk, L.wv), h)                       # [n, q_dim], [n, kv_dim] x2
            q = q.reshape(n, c.n_head, c.head_dim)                            # q: [n, n_head, head_dim]
            k = k.reshape(n, c.n_head_kv, c.head_dim)                         # k: [n, n_head_kv, head_dim]
            v = v.reshape(n, c.n_head_kv, c.head_dim)                         # v: [n, n_head_kv, head_dim]
            q, k = B.rope_qk(q, k, batch.positions, self.inv_freq, neox=True, mscale=c.rope_scaling.mscale)
            window = c.sliding_window if il % 2 == 0 else None
            a = B.attention(q, k, v, cache, il, batch, self.q_scale, window, self.attn_cap)   # [n, n_head*head_dim]
            x, h = B.add_rms_norm(x, B.mul_mat(L.wo, a), L.ffn_norm, c.rms_eps, r_norm=L.post_attn_norm)
            f = B.glu(L.gate, L.up, h, "gelu")                                # f: [n, n_ff]
            if il + 1 < len(self.layers):                                         # the next layer's attention norm
                x, h = B.add_rms_norm(x, B.mul_mat(L.down, f), self.layers[il + 1].attn_norm, c.rms_eps,
                                      r_norm=L.post_ffn_norm)
            else:
                x = B.add(x, B.rms_norm(B.mul_mat(L.down, f), L.post_ffn_norm, c.rms_eps))
        if len(batch.logit_rows) == 0:                                     # a ubatch that only fills the cache
            return None
        x = B.rms_norm(B.rows(x, batch.logit_rows), self.output_norm, c.rms_eps)   # x: [n_out, n_embd]
        logits = B.mul_mat(self.output, x)                                        # logits: [n_out, n_vocab]
        return B.softcap(logits, self.final_cap) if self.final_cap else logits
