"""Hyperparameters of a transformer, read from GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass

from ..gguf import GGUFError, GGUFFile


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

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> "ModelConfig":
        n_embd = int(f.require("embedding_length"))
        n_head = int(f.require("attention.head_count"))
        n_head_kv = f.get("attention.head_count_kv", n_head)
        if not isinstance(n_head_kv, int):  # per-layer arrays are not supported
            raise GGUFError(f"{f.path}: per-layer attention.head_count_kv is not supported")
        head_dim = int(f.get("attention.key_length", n_embd // n_head))
        if n_head <= 0 or n_head_kv <= 0 or n_head % n_head_kv:
            raise GGUFError(f"{f.path}: head counts {n_head}/{n_head_kv} are not a valid GQA layout")
        tokens = f.get("tokenizer.ggml.tokens")
        window = f.get("attention.sliding_window")
        return cls(
            architecture=f.architecture,
            n_layer=int(f.require("block_count")),
            n_embd=n_embd,
            n_ff=int(f.require("feed_forward_length")),
            n_head=n_head,
            n_head_kv=int(n_head_kv),
            head_dim=head_dim,
            n_rot=int(f.get("rope.dimension_count", head_dim)),
            rope_base=float(f.get("rope.freq_base", 10000.0)),
            rms_eps=float(f.get("attention.layer_norm_rms_epsilon", 1e-5)),
            n_ctx_train=int(f.get("context_length", 2048)),
            n_vocab=int(f.get("vocab_size", len(tokens) if tokens is not None else 0)),
            sliding_window=int(window) if window else None,
        )
