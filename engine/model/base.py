"""What every architecture shares: loading named weights through the backend, checking their shapes."""
from __future__ import annotations

from types import SimpleNamespace

from ..gguf import GGUFError, GGUFFile
from ..quants import UnsupportedTypeError
from .config import ModelConfig


class ModelLoadError(ValueError):
    pass


class Transformer:
    """Base of the model files: `forward(batch, cache) -> logits [n_out, n_vocab]`."""

    def __init__(self, gguf: GGUFFile, backend, config: ModelConfig):
        self.gguf, self.B, self.cfg = gguf, backend, config

    def weight(self, name: str, shape: tuple[int, ...] | None = None, optional: bool = False):
        """Load tensor `name`; `shape` in numpy order (rows, cols) is checked when given."""
        info = self.gguf.tensors.get(name)
        if info is None:
            if optional:
                return None
            raise ModelLoadError(f"{self.gguf.path}: tensor '{name}' is missing")
        if shape is not None and info.np_shape != tuple(shape):
            raise ModelLoadError(f"{self.gguf.path}: tensor '{name}' has shape {list(info.np_shape)}, "
                                 f"expected {list(shape)}")
        try:
            return self.B.weight(info, self.gguf.tensor_data(name))
        except UnsupportedTypeError as e:
            raise ModelLoadError(f"{self.gguf.path}: tensor '{name}': {e}") from None

    def output_weight(self, tied):
        """`output.weight`, or the token embeddings when the file ties them."""
        c = self.cfg
        out = self.weight("output.weight", (c.n_vocab, c.n_embd), optional=True)
        return tied if out is None else out

    def layer_weights(self, il: int, names: dict[str, tuple[str, tuple[int, ...] | None]]) -> SimpleNamespace:
        """{attr: (tensor suffix, shape)} -> a namespace of blk.{il}.* weights."""
        return SimpleNamespace(**{attr: self.weight(f"blk.{il}.{suffix}", shape)
                                  for attr, (suffix, shape) in names.items()})

    def new_cache(self, n_seq: int, n_ctx: int):
        c = self.cfg
        return self.B.kv_cache(c.n_layer, n_seq, n_ctx, c.n_head_kv, c.head_dim)


__all__ = ["Transformer", "ModelLoadError", "GGUFError"]
