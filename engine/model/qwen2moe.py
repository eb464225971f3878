"""Qwen 2 MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): the Qwen 2 block with a mixture of experts for its FFN (moe.py),
the chosen experts' softmax weights as they are, plus a shared expert under a sigmoid gate."""
from .moe import MoeFFN
from .qwen2 import Qwen2


class Qwen2Moe(MoeFFN, Qwen2):
    NORM_TOPK = False
    SHARED_EXPERT = True
