"""Qwen 3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen 3 block with its FFN a mixture of experts: a router picks
expert_used_count of expert_count SwiGLU experts per token (softmax over all experts, the chosen weights renormalized
to sum to one), their outputs summed with those weights."""
from .base import ModelLoadError
from .qwen3 import Qwen3


class Qwen3Moe(Qwen3):
    def __init__(self, gguf, backend, config, shard=None):
        if not config.n_expert:
            raise ModelLoadError(f"{gguf.path}: a qwen3moe file without expert_count")
        if not backend.supports_moe:
            raise ModelLoadError(f"{gguf.path}: mixture-of-experts layers run on the CPU backend only so far "
                                 f"(--device cpu); the {backend.name} backend has no expert kernels yet")
        super().__init__(gguf, backend, config, shard)

    def block_weight_names(self):
        c = self.cfg
        names = {k: v for k, v in super().block_weight_names().items() if k not in ("gate", "up", "down")}
        return names | {"router": ("ffn_gate_inp.weight", (c.n_expert, c.n_embd))}

    def load_block(self, il: int):
        c = self.cfg
        L = super().load_block(il)
        L.gates = self.expert_weights(f"blk.{il}.ffn_gate_exps.weight", (c.n_expert, c.n_ff_exp, c.n_embd))
        L.ups = self.expert_weights(f"blk.{il}.ffn_up_exps.weight", (c.n_expert, c.n_ff_exp, c.n_embd))
        L.downs = self.expert_weights(f"blk.{il}.ffn_down_exps.weight", (c.n_expert, c.n_embd, c.n_ff_exp))
        return L

    def ffn(self, L, h):
        return self.B.moe(L.router, L.gates, L.ups, L.downs, h, self.cfg.n_expert_used, "silu")
