"""Mixtral (8x7B, 8x22B): a llama file with expert_count, the llama block with a mixture of experts for its FFN
(moe.py), the chosen experts' weights renormalized."""
from .llama import Llama
from .moe import MoeFFN


class Mixtral(MoeFFN, Llama):
    pass
