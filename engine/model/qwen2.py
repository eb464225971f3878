"""Qwen 2 / 2.5 (and DeepSeek-R1-Distill-Qwen): the llama block with q/k/v biases and RoPE on halves."""
from .llama import Llama


class Qwen2(Llama):
    NEOX = True
    QKV_BIAS = True
