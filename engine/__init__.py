"""A Python inference engine for GGUF language models."""
__version__ = "0.1.0"
