"""What every architecture shares: loading named weights through the backend, checking their shapes."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ..gguf import GGUFError, GGUFFile, TensorInfo
from ..quants import TYPES, GGMLType, UnsupportedTypeError
from ..parallel.shard import VOCAB_ROWS, Shard
from .config import ModelConfig

KV_TYPE_BYTES = {t: TYPES[g].type_size / TYPES[g].block_size      # bytes per cached value of each KV type a backend
                 for t, g in (("f16", GGMLType.F16), ("q8_0", GGMLType.Q8_0))}   # may offer


class ModelLoadError(ValueError):
    pass


class Transformer:
    """Base of the model files: `forward(batch, cache) -> logits [n_out, n_vocab]`.

    Under tensor parallelism (engine/parallel) a model object is one rank's part: `shard` says which heads, FFN
    columns and vocabulary rows it holds; `cfg` stays the file's whole model. Its forward is the same code: head
    counts are read off the arrays, and the backend's all_reduce / gather_vocab join the ranks (nothing on one)."""

    def __init__(self, gguf: GGUFFile, backend, config: ModelConfig, shard: Shard | None = None):
        self.gguf, self.B, self.cfg = gguf, backend, config
        self.shard = shard or Shard.whole(config)

    def _info(self, name: str, shape: tuple[int, ...] | None, optional: bool = False):
        """Tensor `name`'s info, its shape (numpy order) checked when given; None if optional and absent."""
        info = self.gguf.tensors.get(name)
        if info is None:
            if optional:
                return None
            raise ModelLoadError(f"{self.gguf.path}: tensor '{name}' is missing")
        if shape is not None and info.np_shape != tuple(shape):
            raise ModelLoadError(f"{self.gguf.path}: tensor '{name}' has shape {list(info.np_shape)}, "
                                 f"expected {list(shape)}")
        return info

    def _upload(self, name: str, info: TensorInfo, data):
        """The backend's form of a tensor (or of this rank's part of it)."""
        try:
            return self.B.weight(info, data)
        except UnsupportedTypeError as e:
            raise ModelLoadError(f"{self.gguf.path}: tensor '{name}': {e}") from None

    def weight(self, name: str, shape: tuple[int, ...] | None = None, optional: bool = False, role: str | None = None):
        """Load tensor `name` (this rank's part of it: the role its name gives, or `role`); `shape` in numpy order
        (rows, cols), the whole file's, is checked when given."""
        info = self._info(name, shape, optional)
        if info is None:
            return None
        return self._upload(name, *self.shard.cut(info, self.gguf.tensor_data(name), role or self.shard.role(name)))

    def weight_rows(self, name: str, cols: int, row_counts: list[int], roles: list[str]) -> list:
        """A fused matrix (Phi-3's attn_qkv, ffn_up) loaded as the matrices its consecutive row ranges are, each
        still in the file's blocks: [weight of rows 0..n0, of n0..n0+n1, ...]; part i is cut for this rank as a
        tensor of role roles[i] (engine/parallel/shard.py)."""
        rows = sum(row_counts)
        info = self._info(name, (rows, cols))
        data, row_bytes = self.gguf.tensor_data(name), info.nbytes // rows
        out, r0 = [], 0
        for n, role in zip(row_counts, roles):
            part = TensorInfo(f"{name}[{r0}:{r0 + n}]", info.type, (cols, n), info.offset + r0 * row_bytes,
                              n * row_bytes)
            out.append(self._upload(name, *self.shard.cut(part, data[r0 * row_bytes:(r0 + n) * row_bytes], role)))
            r0 += n
        return out

    def expert_weights(self, name: str, shape: tuple[int, int, int]) -> list:
        """A mixture-of-experts tensor [n_expert, rows, cols] (numpy order) loaded as one weight per expert, each
        still in the file's blocks (this rank's part of each)."""
        info = self._info(name, shape)
        data, n, role = self.gguf.tensor_data(name), shape[0], self.shard.role(name)
        per = info.nbytes // n
        return [self._upload(name, *self.shard.cut(TensorInfo(f"{name}[{e}]", info.type, (shape[2], shape[1]),
                                                              info.offset + e * per, per),
                                                   data[e * per:(e + 1) * per], role))
                for e in range(n)]

    def load_embeddings(self) -> None:
        """token_embd, output_norm, and output (the token embeddings when the file ties them). Under tensor
        parallelism both hold a rank's vocabulary rows."""
        c = self.cfg
        rows = VOCAB_ROWS if self.shard.size > 1 else None
        self.tok_embd = self.weight("token_embd.weight", (c.n_vocab, c.n_embd), role=rows)
        self.output_norm = self.weight("output_norm.weight", (c.n_embd,))
        out = self.weight("output.weight", (c.n_vocab, c.n_embd), optional=True)
        self.output = self.tok_embd if out is None else out

    def embed(self, tokens):
        """The tokens' embeddings [n, n_embd]. Split over ranks, each rank gives the rows of the tokens in its
        vocabulary and zeros for the others', summed by the all-reduce."""
        if self.shard.size == 1:
            return self.B.embed(self.tok_embd, tokens)
        return self.B.all_reduce(self.B.embed(self.tok_embd, tokens, self.shard.vocab.start))

    def block_weight_names(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The attention and gated-FFN weights every block of these architectures has: {attr: (suffix, shape)}."""
        c = self.cfg
        q_dim, kv_dim = c.n_head * c.head_dim, c.n_head_kv * c.head_dim
        return {
            "attn_norm": ("attn_norm.weight", (c.n_embd,)),
            "wq": ("attn_q.weight", (q_dim, c.n_embd)),
            "wk": ("attn_k.weight", (kv_dim, c.n_embd)),
            "wv": ("attn_v.weight", (kv_dim, c.n_embd)),
            "wo": ("attn_output.weight", (c.n_embd, q_dim)),
            "ffn_norm": ("ffn_norm.weight", (c.n_embd,)),
            "gate": ("ffn_gate.weight", (c.n_ff, c.n_embd)),
            "up": ("ffn_up.weight", (c.n_ff, c.n_embd)),
            "down": ("ffn_down.weight", (c.n_embd, c.n_ff)),
        }

    def layer_weights(self, il: int, names: dict[str, tuple[str, tuple[int, ...] | None]]) -> SimpleNamespace:
        """{attr: (tensor suffix, shape)} -> a namespace of blk.{il}.* weights."""
        return SimpleNamespace(**{attr: self.weight(f"blk.{il}.{suffix}", shape)
                                  for attr, (suffix, shape) in names.items()})

    def set_context(self, n_ctx: int) -> None:
        """The context the runtime sizes its cache for (LongRoPE picks its factors by it); before the first forward."""

    def new_cache(self, n_blocks: int, block_size: int, kv_type: str | None = None):
        """The KV cache of this rank's KV heads: n_blocks blocks of block_size positions, of the backend's type or
        kv_type (one of its kv_types)."""
        c = self.cfg
        kw = {} if kv_type is None else {"kv_type": kv_type}
        return self.B.kv_cache(c.n_layer, n_blocks, block_size, len(self.shard.kv_heads), c.head_dim, **kw)

    def kv_bytes_per_token(self, kv_type: str | None = None) -> float:
        """KV-cache bytes one position of one sequence takes on this rank (keys and values of every layer)."""
        c = self.cfg
        per_value = KV_TYPE_BYTES[kv_type] if kv_type else np.dtype(self.B.kv_dtype).itemsize
        return 2 * c.n_layer * len(self.shard.kv_heads) * c.head_dim * per_value


__all__ = ["Transformer", "ModelLoadError", "GGUFError"]
