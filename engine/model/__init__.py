"""Model registry: general.architecture -> the class that implements it."""
from __future__ import annotations

from ..gguf import GGUFFile, quoted
from .base import ModelLoadError, Transformer
from .config import ModelConfig
from .gemma3 import Gemma3
from .llama import Llama

ARCHITECTURES: dict[str, type[Transformer]] = {"llama": Llama, "gemma3": Gemma3}


def load_model(gguf: GGUFFile, backend) -> Transformer:
    arch = gguf.architecture
    cls = ARCHITECTURES.get(arch)
    if cls is None:
        raise ModelLoadError(f"{gguf.path}: unsupported architecture '{quoted(arch)}' "
                             f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return cls(gguf, backend, ModelConfig.from_gguf(gguf))


__all__ = ["ARCHITECTURES", "load_model", "ModelLoadError", "ModelConfig"]
