"""Gemma 2: Gemma 3's block without the q/k norms, with capped attention scores (attn_logit_softcapping) and final
logits (final_logit_softcapping), a sliding window on every other layer (the even ones), one rope base."""
from __future__ import annotations

import math

from .gemma3 import Gemma3


class Gemma2(Gemma3):
    QK_NORM = False

    def __init__(self, gguf, backend, config, shard=None):
        super().__init__(gguf, backend, config, shard)
        c = config
        self.attn_cap = gguf.number("attn_logit_softcapping", 0.0, 1e6, 50.0)
        self.final_cap = gguf.number("final_logit_softcapping", 0.0, 1e6, 30.0)
        # queries scaled by 1/sqrt(head_dim), as llama.cpp does, except the 27B (46 layers): 1/sqrt(n_embd / n_head)
        self.q_scale = 1.0 / math.sqrt(c.n_embd // c.n_head if c.n_layer == 46 else c.head_dim)

    def is_sliding(self, il: int) -> bool:
        return self.cfg.sliding_window is not None and il % 2 == 0

    def rope_of(self, il: int) -> tuple:
        return self.inv_freq_global, self.cfg.rope_scaling.mscale
