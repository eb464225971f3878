"""Model registry: general.architecture -> the class that implements it."""
from __future__ import annotations

from ..gguf import GGUFFile, quoted
from .base import ModelLoadError, Transformer
from .config import ModelConfig
from .gemma2 import Gemma2
from .gemma3 import Gemma3
from .llama import Llama
from .mixtral import Mixtral
from .phi3 import Phi3
from .qwen2 import Qwen2
from .qwen3 import Qwen3
from .qwen2moe import Qwen2Moe
from .qwen3moe import Qwen3Moe

ARCHITECTURES: dict[str, type[Transformer]] = {"llama": Llama, "gemma3": Gemma3, "qwen2": Qwen2, "qwen3": Qwen3,
                                              "phi3": Phi3, "gemma2": Gemma2, "qwen3moe": Qwen3Moe,
                                              "qwen2moe": Qwen2Moe}


# general.architecture values whose files may have a mixture of experts for an FFN (expert_count set): their class then
MOE_VARIANTS: dict[str, type[Transformer]] = {"llama": Mixtral}


def model_class(gguf: GGUFFile) -> type[Transformer]:
    """The class of the file's general.architecture, or a ModelLoadError naming the supported ones."""
    arch = gguf.architecture
    cls = ARCHITECTURES.get(arch)
    if arch in MOE_VARIANTS and gguf.get("expert_count", 0):
        cls = MOE_VARIANTS[arch]
    if cls is None:
        raise ModelLoadError(f"{gguf.path}: unsupported architecture '{quoted(arch)}' "
                             f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return cls


def load_model(gguf: GGUFFile, backend, shard=None) -> Transformer:
    """The file's model on a backend; `shard` (engine/parallel/shard.py): one tensor-parallel rank's part of it."""
    return model_class(gguf)(gguf, backend, ModelConfig.from_gguf(gguf), shard)


__all__ = ["ARCHITECTURES", "load_model", "model_class", "ModelLoadError", "ModelConfig"]
