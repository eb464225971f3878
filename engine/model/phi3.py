"""Phi-3 / Phi-3.5 (mini, medium): the llama block with RoPE on halves and fused tensors, attn_qkv ([q; k; v] rows)
and ffn_up ([gate; up] rows), loaded as the separate matrices their row ranges are."""
from types import SimpleNamespace

from ..parallel.shard import FF_ROWS, KV_ROWS, Q_ROWS
from .llama import Llama


class Phi3(Llama):
    NEOX = True

    def load_block(self, il: int):
        c = self.cfg
        q_dim, kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        names = {k: v for k, v in self.block_weight_names().items() if k not in ("wq", "wk", "wv", "gate", "up")}
        layer = vars(self.layer_weights(il, names))
        layer["wq"], layer["wk"], layer["wv"] = self.weight_rows(f"blk.{il}.attn_qkv.weight", c.n_embd,
                                                                 [q_dim, kv_dim, kv_dim], [Q_ROWS, KV_ROWS, KV_ROWS])
        layer["gate"], layer["up"] = self.weight_rows(f"blk.{il}.ffn_up.weight", c.n_embd, [c.n_ff, c.n_ff],
                                                      [FF_ROWS, FF_ROWS])
        return SimpleNamespace(**layer)
