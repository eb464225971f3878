"""The llama family: Llama 2/3, Mistral, SmolLM2 (GQA, RoPE on adjacent pairs, SwiGLU, optional tied output)."""
from __future__ import annotations

import math

from ..backends.base import Batch
from .base import Transformer


class Llama(Transformer):
    def __init__(self, gguf, backend, config):
        super().__init__(gguf, backend, config)
        self.load_embeddings()
        self.layers = [self.layer_weights(il, self.block_weight_names()) for il in range(config.n_layer)]

    def forward(self, batch: Batch, cache):
        B, c = self.B, self.cfg
        n = len(batch.tokens)
        x = B.embed(self.tok_embd, batch.tokens)                          # x: [n, n_embd]
        h = B.rms_norm(x, self.layers[0].attn_norm, c.rms_eps)             # h: [n, n_embd], the normed residual
        for il, L in enumerate(self.layers):
            q, k, v = B.mul_mats((L.wq, L.wk, L.wv), h)                              # [n, q_dim], [n, kv_dim] x2
            q = q.reshape(n, c.n_head, c.head_dim)                            # q: [n, n_head, head_dim]
            k = k.reshape(n, c.n_head_kv, c.head_dim)                         # k: [n, n_head_kv, head_dim]
            v = v.reshape(n, c.n_head_kv, c.head_dim)                         # v: [n, n_head_kv, head_dim]
            q, k = B.rope_qk(q, k, batch.positions, c.n_rot, c.rope_base, neox=False)
            a = B.attention(q, k, v, cache, il, batch, 1.0 / math.sqrt(c.head_dim), None)  # a: [n, n_head*head_dim]
            x, h = B.add_rms_norm(x, B.mul_mat(L.wo, a), L.ffn_norm, c.rms_eps)
            f = B.glu(L.gate, L.up, h, "silu")                                # f: [n, n_ff]
            if il + 1 < len(self.layers):                                  # the next layer's attention norm
                x, h = B.add_rms_norm(x, B.mul_mat(L.down, f), self.layers[il + 1].attn_norm, c.rms_eps)
            else:
                x = B.add(x, B.mul_mat(L.down, f))
        if len(batch.logit_rows) == 0:                                     # a ubatch that only fills the cache
            return None
        x = B.rms_norm(B.rows(x, batch.logit_rows), self.output_norm, c.rms_eps)   # x: [n_out, n_embd]
        return B.mul_mat(self.output, x)                                   # logits: [n_out, n_vocab]
