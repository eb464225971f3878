"""Mixture-of-experts FFNs for the llama-family blocks (qwen3moe.py, qwen2moe.py): a router picks expert_used_count
of expert_count SwiGLU experts per token (softmax over all experts; the chosen weights renormalized to sum to one
where the architecture does so), their outputs summed with those weights; Qwen 2 MoE adds a shared expert, scaled by
a sigmoid gate of its own. The mixin replaces the block's dense FFN (Llama.ffn) with the backend's moe()."""
from .base import ModelLoadError


class MoeFFN:
    NORM_TOPK = True        # the chosen experts' weights renormalized to sum to one
    SHARED_EXPERT = False   # a shared expert beside the routed ones (ffn_*_shexp, gated by ffn_gate_inp_shexp)

    def __init__(self, gguf, backend, config, shard=None):
        if not config.n_expert:
            raise ModelLoadError(f"{gguf.path}: a {config.architecture} file without expert_count")
        if not backend.supports_moe:
            raise ModelLoadError(f"{gguf.path}: mixture-of-experts layers run on the CPU backend only so far "
                                 f"(--device cpu); the {backend.name} backend has no expert kernels yet")
        super().__init__(gguf, backend, config, shard)

    def block_weight_names(self):
        c = self.cfg
        names = {k: v for k, v in super().block_weight_names().items() if k not in ("gate", "up", "down")}
        names["router"] = ("ffn_gate_inp.weight", (c.n_expert, c.n_embd))
        if self.SHARED_EXPERT:
            names |= {"shared_gate_inp": ("ffn_gate_inp_shexp.weight", (c.n_embd,)),
                      "shared_gate": ("ffn_gate_shexp.weight", (c.n_ff_shexp, c.n_embd)),
                      "shared_up": ("ffn_up_shexp.weight", (c.n_ff_shexp, c.n_embd)),
                      "shared_down": ("ffn_down_shexp.weight", (c.n_embd, c.n_ff_shexp))}
        return names

    def load_block(self, il: int):
        c = self.cfg
        L = super().load_block(il)
        L.gates = self.expert_weights(f"blk.{il}.ffn_gate_exps.weight", (c.n_expert, c.n_ff_exp, c.n_embd))
        L.ups = self.expert_weights(f"blk.{il}.ffn_up_exps.weight", (c.n_expert, c.n_ff_exp, c.n_embd))
        L.downs = self.expert_weights(f"blk.{il}.ffn_down_exps.weight", (c.n_expert, c.n_embd, c.n_ff_exp))
        return L

    def ffn(self, L, h):
        shared = (L.shared_gate_inp, L.shared_gate, L.shared_up, L.shared_down) if self.SHARED_EXPERT else None
        return self.B.all_reduce(self.B.moe(L.router, L.gates, L.ups, L.downs, h, self.cfg.n_expert_used, "silu",
                                            norm=self.NORM_TOPK, shared=shared))   # (each rank: its columns of each)
