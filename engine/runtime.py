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
from .kv_blocks import KV_BLOCK_SIZE, TableRows
from .model import load_model, model_class
from .parallel.config import ParallelConfig
from .sampling import Sampler, SamplingParams
from .tokenizer import Tokenizer

DEFAULT_CTX = 4096


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
                 n_ubatch: int | None = None, exact: bool = False, n_seq: int = 1, kv_f32: bool = False,
                 cuda=None, tensor_parallel=1, kv_memory: float | None = None, kv_type: str | None = None,
                 batch_invariant: bool = False):
        """n_seq: the sequences that can be in flight at once. kv_memory: bytes of KV cache (a paged cache's blocks;
        None: enough for n_seq whole contexts). kv_type: the cache's type when not the backend's own (f32 on the
        CPU, f16 on the GPU): one of the backend's kv_types. batch_invariant: a sequence's logits do not depend on
        the others in its steps (get_backend). n_ubatch: tokens of one prefill ubatch (None: the backend's
        prefill_ubatch)."""
        self.gguf = gguf
        model_class(gguf)                          # an unsupported architecture is the first thing to say
        self.tokenizer = Tokenizer(gguf)
        parallel = ParallelConfig.of(tensor_parallel)       # a rank count, or where the ranks run
        parallel.validate()
        if parallel.size > 1 and batch_invariant:
            raise ValueError("--batch-invariant runs on one rank only (not with --tensor-parallel)")
        if kv_f32 and kv_type is not None:
            raise ValueError(f"--kv-f32 and --kv-type {kv_type} both name the KV cache's type: give one")
        if parallel.size > 1:                      # the model split over ranks (engine/parallel), driven as one
            from .parallel.group import load_parallel
            self.backend, self.model = load_parallel(gguf, parallel, device, exact, kv_f32, cuda)
        else:
            self.backend = get_backend(device, exact, kv_f32, cuda, batch_invariant)
            self.model = load_model(gguf, self.backend)
        self.tensor_parallel = parallel.size
        self.backend.prepare_kernels()
        self.config = self.model.cfg
        n_ubatch = self.backend.prefill_ubatch if n_ubatch is None else n_ubatch
        if n_ubatch < 1:
            raise ValueError("n_ubatch must be >= 1")
        if n_ctx is not None and n_ctx < 1:
            raise ValueError("n_ctx must be >= 1")
        self.n_ctx = n_ctx or min(DEFAULT_CTX, self.config.n_ctx_train)
        self.model.set_context(self.n_ctx)
        self.n_ubatch = n_ubatch
        self.n_seq = n_seq
        if kv_type is not None and kv_type not in self.backend.kv_types:
            from .backends.cpu import CPUBackend
            offered = (f"it offers {', '.join(self.backend.kv_types)}" if self.backend.kv_types else
                       f"it has only its own; the cpu backend offers {', '.join(CPUBackend.kv_types)}")
            raise ValueError(f"the {self.backend.name} backend's KV cache cannot be {kv_type} ({offered})")
        self.kv_type = kv_type
        self._size_cache(kv_memory)
        self._table_rows = TableRows(self.blocks_per_seq)       # the batches' block tables, converted once
        self.cache = self.model.new_cache(self.n_blocks, self.block_size, kv_type)

    def _size_cache(self, kv_memory: float | None) -> None:
        """Blocks of KV_BLOCK_SIZE positions on a paged backend, else one block of the whole context per sequence;
        as many as kv_memory holds, or n_seq whole contexts."""
        paged = self.backend.paged_kv and KV_BLOCK_SIZE < self.n_ctx
        self.block_size = KV_BLOCK_SIZE if paged else self.n_ctx
        self.blocks_per_seq = -(-self.n_ctx // self.block_size)        # a whole context's blocks
        self.n_blocks = self.n_seq * self.blocks_per_seq
        if kv_memory is None:
            return
        if not self.backend.paged_kv:
            raise ValueError(f"the {self.backend.name} backend's attention reads one contiguous KV cache per sequence, "
                             f"sized by the parallel sequences and the context; a KV memory size needs a paged cache "
                             f"(the cpu and cuda backends)")
        per_block = self.block_size * self.model.kv_bytes_per_token(self.kv_type)
        self.n_blocks = int(kv_memory // per_block)
        if self.n_blocks < self.blocks_per_seq:
            raise ValueError(f"a KV memory of {kv_memory / 2**30:.4g} GiB holds {self.n_blocks * self.block_size} "
                             f"positions, fewer than one sequence's context of {self.n_ctx} "
                             f"({self.blocks_per_seq * per_block / 2**30:.4g} GiB)")

    @classmethod
    def load(cls, model: str | None = None, **kw) -> "Runtime":
        return cls(GGUFFile(resolve_model(model)), **kw)

    # -- forward passes ----------------------------------------------------------------------------------------
    def check_fits(self, n_prompt: int) -> None:
        if n_prompt == 0:
            raise ContextLengthError("the prompt is empty")
        if n_prompt > self.n_ctx:
            raise ContextLengthError(f"the prompt has {n_prompt} tokens, more than the context of {self.n_ctx}")

    def forward(self, tokens: list[int], positions: list[int], seqs: list[int], logit_rows: list[int],
                tables: dict[int, list[int]] | None = None):
        """One forward over any mix of sequences (each one's tokens contiguous, in order; the scheduler puts decode
        rows first) -> the backend's logits [len(logit_rows), n_vocab] (None without rows). tables: each sequence's
        KV blocks (engine/kv_blocks.py); None: sequence s has the s-th whole context's blocks (static_blocks)."""
        if len(positions) and max(positions) >= self.n_ctx:
            raise ContextLengthError(f"position {max(positions)} is past the context of {self.n_ctx} tokens")
        return self.backend.forward(self.model, self._batch(tokens, positions, seqs, logit_rows, tables), self.cache)

    def _batch(self, tokens, positions, seqs, logit_rows, tables=None) -> Batch:
        if self.block_size >= self.n_ctx:        # one block per sequence: the batch names it
            if tables is not None:
                seqs = [tables[s][0] for s in seqs]
            return Batch.make(tokens, positions, seqs, logit_rows)
        if tables is None:
            tables = {s: self.static_blocks(s) for s in set(int(s) for s in seqs)}
        return Batch.make(tokens, positions, seqs, logit_rows, self._table_rows.of(tables), width=self.blocks_per_seq)

    def static_blocks(self, seq: int) -> list[int]:
        """The blocks of sequence seq when nobody hands out blocks (prefill, decode, generate): the seq-th whole
        context's."""
        first = seq * self.blocks_per_seq
        if first + self.blocks_per_seq > self.n_blocks:
            raise ValueError(f"sequence {seq} has no blocks of its own in a KV cache of {self.n_blocks} blocks "
                             f"(the Scheduler hands out blocks)")
        return list(range(first, first + self.blocks_per_seq))

    def scratch_tables(self, seqs, n_positions: int) -> dict[int, list[int]]:
        """Blocks for steps whose results nobody keeps (a server's warm-up): n_positions for each of seqs, distinct
        while the cache has enough."""
        k = -(-n_positions // self.block_size)
        return {s: [(i * k + j) % self.n_blocks for j in range(k)] for i, s in enumerate(sorted(set(seqs)))}

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
            positions = np.arange(start + a, start + a + len(chunk))
            if not (all_logits or (last and logits)):
                self.forward(chunk, positions, [seq] * len(chunk), [])
                continue
            out = self.forward(chunk, positions, [seq] * len(chunk), np.arange(len(chunk)) if all_logits else
                               [len(chunk) - 1])
            if on_device:
                return out
            outs.append(self.backend.to_numpy(out))
        return np.concatenate(outs, axis=0) if outs else None

    def decode(self, seqs: list[int], tokens: list[int], positions: list[int], greedy: bool = False) -> np.ndarray:
        """One decode step for several sequences, one new token each -> logits [len(seqs), n_vocab], or with
        greedy=True each sequence's argmax token [len(seqs)] (taken on the device: the logits stay there)."""
        logits = self.forward(tokens, positions, seqs, np.arange(len(tokens)))
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
