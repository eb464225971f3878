"""The llama family: Llama 2/3, Mistral, SmolLM2 (GQA, RoPE on adjacent pairs, SwiGLU, optional tied output)."""
from __future__ import annotations

import math

from ..backends.base import Batch
from .base import Transformer


class Llama(Transformer):
    def __init__(self, gguf, backend, config):
        super().__init__(gguf, backend, config)
        c = config
        q_dim, kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        self.tok_embd = self.weight("token_embd.weight", (c.n_vocab, c.n_embd))
        self.output_norm = self.weight("output_norm.weight", (c.n_embd,))
        self.output = self.output_weight(self.tok_embd)
        self.layers = [self.layer_weights(il, {
            "attn_norm": ("attn_norm.weight", (c.n_embd,)),
            "wq": ("attn_q.weight", (q_dim, c.n_embd)),
            "wk": ("attn_k.weight", (kv_dim, c.n_embd)),
            "wv": ("attn_v.weight", (kv_dim, c.n_embd)),
            "wo": ("attn_output.weight", (c.n_embd, q_dim)),
            "ffn_norm": ("ffn_norm.weight", (c.n_embd,)),
            "gate": ("ffn_gate.weight", (c.n_ff, c.n_embd)),
            "up": ("ffn_up.weight", (c.n_ff, c.n_embd)),
            "down": ("ffn_down.weight", (c.n_embd, c.n_ff)),
        }) for il in range(c.n_layer)]

    def forward(self, batch: Batch, cache):
        B, c = self.B, self.cfg
        n = len(batch.tokens)
        x = B.embed(self.tok_embd, batch.tokens)                          # x: [n, n_embd]
        for il, L in enumerate(self.layers):
            h = B.rms_norm(x, L.attn_norm, c.rms_eps)                      # h: [n, n_embd]
            q = B.mul_mat(L.wq, h).reshape(n, c.n_head, c.head_dim)        # q: [n, n_head, head_dim]
            k = B.mul_mat(L.wk, h).reshape(n, c.n_head_kv, c.head_dim)     # k: [n, n_head_kv, head_dim]
            v = B.mul_mat(L.wv, h).reshape(n, c.n_head_kv, c.head_dim)     # v: [n, n_head_kv, head_dim]
            q = B.rope(q, batch.positions, c.n_rot, c.rope_base, neox=False)
            k = B.rope(k, batch.positions, c.n_rot, c.rope_base, neox=False)
            a = B.attention(q, k, v, cache, il, batch, 1.0 / math.sqrt(c.head_dim), None)  # a: [n, n_head*head_dim]
            x = B.add(x, B.mul_mat(L.wo, a))
            h = B.rms_norm(x, L.ffn_norm, c.rms_eps)
            f = B.swiglu(B.mul_mat(L.gate, h), B.mul_mat(L.up, h))         # f: [n, n_ff]
            x = B.add(x, B.mul_mat(L.down, f))
        x = B.rms_norm(B.rows(x, batch.logit_rows), self.output_norm, c.rms_eps)   # x: [n_out, n_embd]
        return B.mul_mat(self.output, x)                                   # logits: [n_out, n_vocab]
