"""Qwen 3 MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): the Qwen 3 block with a mixture of experts for its FFN (moe.py),
the chosen experts' weights renormalized."""
from .moe import MoeFFN
from .qwen3 import Qwen3


class Qwen3Moe(MoeFFN, Qwen3):
    pass
