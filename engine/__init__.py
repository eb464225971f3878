"""A Python inference engine for GGUF language models.

    from engine import LLM, SamplingParams          # engine/llm.py (loaded on first use)
"""
__version__ = "0.1.0"


def __getattr__(name):
    if name in ("LLM", "Completion", "SamplingParams"):
        from . import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
