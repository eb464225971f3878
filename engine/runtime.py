"""Load a model, prefill prompts in ubatches, decode token by token: the engine's core loop.

    rt = Runtime.load("smollm2-135m", device="cpu")
    for tok in rt.generate(rt.tokenizer.encode("Hello"), SamplingParams(temperature=0), max_tokens=16):
        ...
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .backends import get_backend
from .backends.base import Batch
from .gguf import GGUFFile
from .hub import resolve_model
from .model import load_model, model_class
from .parallel.config import ParallelConfig
from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer

DEFAULT_CTX = 4096
DEFAULT_UBATCH = 512


class ContextLengthError(ValueError):
    pass


@dataclass
class Timings:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    time_to_first_token: float = 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_tokens_per_s": self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0,
            "generated_tokens_per_s": (self.generated_tokens - 1) / self.generate_seconds
            if self.generate_seconds and self.generated_tokens > 1 else 0.0,
            "time_to_first_token_s": self.time_to_first_token,
        }


@dataclass
class Generation:
    """State of one sequence being generated; `finish_reason` is set when it ends."""
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    timings: Timings = field(default_factory=Timings)


class Runtime:
    def __init__(self, gguf: GGUFFile, device: str = "auto", n_ctx: int | None = None,
                 n_ubatch: int = DEFAULT_UBATCH, exact: bool = False, n_seq: int = 1, kv_f32: bool = False,
                 cuda=None, tensor_parallel=1):
        self.gguf = gguf
        model_class(gguf)                          # an unsupported architecture is the first thing to say
        self.tokenizer = Tokenizer(gguf)
        parallel = ParallelConfig.of(tensor_parallel)       # a rank count, or where the ranks run
        parallel.validate()
        if parallel.size > 1:                      # the model split over ranks (engine/parallel), driven as one
            from .parallel.group import load_parallel
            self.backend, self.model = load_parallel(gguf, parallel, device, exact, kv_f32, cuda)
        else:
            self.backend = get_backend(device, exact, kv_f32, cuda)
            self.model = load_model(gguf, self.backend)
        self.tensor_parallel = parallel.size
        self.backend.prepare_kernels()
        self.config = self.model.cfg
        if n_ubatch < 1:
            raise ValueError("n_ubatch must be >= 1")
        if n_ctx is not None and n_ctx < 1:
            raise ValueError("n_ctx must be >= 1")
        self.n_ctx = n_ctx or min(DEFAULT_CTX, self.config.n_ctx_train)
        self.model.set_context(self.n_ctx)
        self.n_ubatch = n_ubatch
        self.n_seq = n_seq
        self.cache = self.model.new_cache(n_seq, self.n_ctx)

    @classmethod
    def load(cls, model: str | None = None, **kw) -> "Runtime":
        return cls(GGUFFile(resolve_model(model)), **kw)

    # -- forward passes ----------------------------------------------------------------------------------------
    def check_fits(self, n_prompt: int) -> None:
        if n_prompt == 0:
            raise ContextLengthError("the prompt is empty")
        if n_prompt > self.n_ctx:
            raise ContextLengthError(f"the prompt has {n_prompt} tokens, more than the context of {self.n_ctx}")

    def forward(self, tokens: list[int], positions: list[int], seqs: list[int], logit_rows: list[int]):
        """One forward over any mix of sequences (each one's tokens contiguous, in order; the scheduler puts decode
        rows first) -> the backend's logits [len(logit_rows), n_vocab] (None without rows)."""
        if positions and max(positions) >= self.n_ctx:
            raise ContextLengthError(f"position {max(positions)} is past the context of {self.n_ctx} tokens")
        batch = Batch.make(tokens, positions, seqs, logit_rows)
        return self.backend.forward(self.model, batch, self.cache)

    def prefill(self, tokens: list[int], seq: int = 0, start: int = 0, all_logits: bool = False,
                logits: bool = True, on_device: bool = False):
        """Run `tokens` (at positions start..) through the model in ubatches; logits of the last token, or of
        every token -> [n_out, n_vocab] float32; None with logits=False (the tokens only fill the cache).
        on_device: the last ubatch's logits as the backend's array, not copied to the host."""
        self.check_fits(start + len(tokens))
        outs = []
        for a in range(0, len(tokens), self.n_ubatch):
            chunk = tokens[a:a + self.n_ubatch]
            last = a + self.n_ubatch >= len(tokens)
            if not (all_logits or (last and logits)):
                batch = Batch.make(chunk, np.arange(start + a, start + a + len(chunk)), np.full(len(chunk), seq), [])
                self.backend.forward(self.model, batch, self.cache)
                continue
            batch = Batch.single(chunk, start + a, seq, all_logits=all_logits)
            out = self.backend.forward(self.model, batch, self.cache)
            if on_device:
                return out
            outs.append(self.backend.to_numpy(out))
        return np.concatenate(outs, axis=0) if outs else None

    def decode(self, seqs: list[int], tokens: list[int], positions: list[int], greedy: bool = False) -> np.ndarray:
        """One decode step for several sequences, one new token each -> logits [len(seqs), n_vocab], or with
        greedy=True each sequence's argmax token [len(seqs)] (taken on the device: the logits stay there)."""
        n = len(tokens)
        batch = Batch.make(tokens, positions, seqs, np.arange(n))
        logits = self.backend.forward(self.model, batch, self.cache)
        return self.backend.argmax(logits) if greedy else self.backend.to_numpy(logits)

    # -- generation --------------------------------------------------------------------------------------------
    def is_end_of_generation(self, tid: int) -> bool:
        return tid in self.tokenizer.eog_ids

    def generate(self, prompt: list[int], params: SamplingParams | None = None, max_tokens: int = 128,
                 ignore_eos: bool = False, seq: int = 0, state: Generation | None = None) -> Iterator[int]:
        """Yield generated token ids; stops at an end-of-generation token (unless ignore_eos), max_tokens, or
        the end of the context. `state`, if given, receives tokens, finish_reason and timings."""
        state = state or Generation(list(prompt))
        self.check_fits(len(prompt))
        sampler = Sampler(params or SamplingParams())
        history = list(prompt)
        t0 = time.perf_counter()
        logits = self.prefill(prompt, seq, on_device=True)                      # [1, n_vocab] on the backend
        pos = len(prompt)
        t_first = None
        while len(state.tokens) < max_tokens:
            tid = int(self.backend.sample(logits, [sampler], [history])[0])
            now = time.perf_counter()
            if t_first is None:                       # the prompt's time runs to its first token's draw
                t_first = now
                state.timings.prompt_tokens, state.timings.prompt_seconds = len(prompt), now - t0
                state.timings.time_to_first_token = now - t0
            if not ignore_eos and self.is_end_of_generation(tid):
                state.finish_reason = "stop"
                return
            state.tokens.append(tid)
            history.append(tid)
            state.timings.generated_tokens, state.timings.generate_seconds = len(state.tokens), now - t_first
            yield tid
            if len(state.tokens) >= max_tokens or pos >= self.n_ctx:
                break
            logits = self.forward([tid], [pos], [seq], [0])
            pos += 1
        state.finish_reason = "length"
