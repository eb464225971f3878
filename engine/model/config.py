"""Hyperparameters of a transformer, read from GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass

from ..gguf import GGUFError, GGUFFile
from .rope import RopeScaling

# Bounds on hyperparameters (far beyond any released model; they keep a corrupt file from sizing huge buffers)
MAX_DIM = 1 << 17
MAX_HEADS = 1 << 10
MAX_HEAD_DIM = 1 << 12
MAX_LAYERS = 1 << 10
MAX_VOCAB = 1 << 22
MAX_CTX = 1 << 24
MAX_EXPERTS = 1 << 10


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int           # key/value length per head
    n_rot: int              # rotated dimensions per head
    rope_base: float
    rms_eps: float
    n_ctx_train: int
    n_vocab: int
    sliding_window: int | None = None
    rope_scaling: RopeScaling = RopeScaling()
    n_expert: int = 0       # mixture of experts: experts per layer (0: a dense FFN)
    n_expert_used: int = 0  # experts each token is routed to
    n_ff_exp: int = 0       # an expert's FFN width
    n_ff_shexp: int = 0     # the shared expert's FFN width (Qwen 2 MoE; 0: none)

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "ModelConfig":
        """Every value checked for its type and range; the model then checks the tensors' shapes against them."""
        n_embd = f.integer("embedding_length", 1, MAX_DIM)
        n_head = f.integer("attention.head_count", 1, MAX_HEADS)
        n_head_kv = f.integer("attention.head_count_kv", 1, MAX_HEADS, default=n_head)
        if n_head % n_head_kv:
            raise GGUFError(f"{f.path}: head counts {n_head}/{n_head_kv} are not a valid GQA layout")
        head_dim = f.integer("attention.key_length", 1, MAX_HEAD_DIM, default=max(1, n_embd // n_head))
        n_rot = f.integer("rope.dimension_count", 0, head_dim, default=head_dim)
        if n_rot % 2:
            raise GGUFError(f"{f.path}: rope.dimension_count {n_rot} is odd")
        tokens = f.get("tokenizer.ggml.tokens")
        n_tokens = len(tokens) if isinstance(tokens, list) else 0
        n_vocab = f.integer("vocab_size", 1, MAX_VOCAB, default=n_tokens or 1)
        if n_tokens and n_tokens != n_vocab:
            raise GGUFError(f"{f.path}: vocab_size {n_vocab} but the tokenizer lists {n_tokens} tokens")
        window = f.integer("attention.sliding_window", 0, MAX_CTX, default=0)
        n_expert = f.integer("expert_count", 0, MAX_EXPERTS, default=0)
        n_expert_used = f.integer("expert_used_count", 0, n_expert, default=0)
        if n_expert and not n_expert_used:
            raise GGUFError(f"{f.path}: expert_count {n_expert} without expert_used_count")
        return cls(
            architecture=f.architecture,
            n_layer=f.integer("block_count", 1, MAX_LAYERS),
            n_embd=n_embd,
            n_ff=f.integer("feed_forward_length", 1, MAX_DIM),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_rot=n_rot,
            rope_base=f.number("rope.freq_base", 1e-3, 1e12, 10000.0),
            rms_eps=f.number("attention.layer_norm_rms_epsilon", 1e-12, 1.0, 1e-5),
            n_ctx_train=f.integer("context_length", 1, MAX_CTX, default=2048),
            n_vocab=n_vocab,
            sliding_window=window or None,
            rope_scaling=RopeScaling.from_gguf(f),
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            n_ff_exp=f.integer("expert_feed_forward_length", 1, MAX_DIM, default=0) if n_expert else 0,
            n_ff_shexp=f.integer("expert_shared_feed_forward_length", 0, MAX_DIM, default=0),
        )
