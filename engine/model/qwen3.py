"""Qwen 3 (dense): the llama block with each head's q and k RMS-normed before RoPE on halves, no biases."""
from .llama import Llama


class Qwen3(Llama):
    NEOX = True
    QK_NORM = True
