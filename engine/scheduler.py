"""Continuous batching: many sequences share the runtime; one decode step serves every running sequence.

    sched = Scheduler(runtime)                       # runtime built with n_seq = the number of KV slots
    sid = sched.submit(Request(prompt_ids, params, max_tokens=64), on_event)
    while sched.step(): ...                          # or sched.run_in_thread()

A step: one ubatch of prefill for the sequence being admitted (a waiting request takes a free KV slot when none
is; its first token is sampled when its prompt is in), then one decode step for every running sequence, so a long
prompt delays the others by one ubatch per step, not by its whole prefill. Requests beyond the free slots wait in a FIFO queue. on_event receives a
TokenEvent per generated token and one FinishEvent, from the scheduler's thread.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .runtime import ContextLengthError, Runtime
from .sampling import Sampler, SamplingParams


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 128
    ignore_eos: bool = False
    top_logprobs: int | None = None     # None: no log-probs; 0: the chosen token's only; k: also the k best


@dataclass
class TokenEvent:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class FinishEvent:
    reason: str                         # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


@dataclass
class _Seq:
    id: int
    req: Request
    on_event: Callable
    slot: int = -1
    pos: int = 0
    sampler: Sampler | None = None
    history: list[int] = field(default_factory=list)
    generated: int = 0
    last: int = -1
    prefilled: int = 0                 # prompt tokens already in the KV cache
    prompt_logits: np.ndarray | None = None   # [n_vocab] logits after the prompt, kept for sharing the prefill


@dataclass
class Stats:
    requests_total: int = 0
    requests_finished: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_shared: int = 0      # prompt tokens copied from a running sequence's cache instead of prefilled
    generated_tokens_total: int = 0
    decode_steps: int = 0
    tokens_per_second: float = 0.0     # generated tokens per second over the last decode steps


class Scheduler:
    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self.free_slots = list(range(runtime.n_seq))
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.prefilling: _Seq | None = None
        self.cancelled: set[int] = set()
        self.stats = Stats()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stop = False
        self._thread: threading.Thread | None = None

    # -- requests --------------------------------------------------------------------------------------------
    def submit(self, req: Request, on_event: Callable) -> int:
        req.params.validate()
        self.rt.check_fits(len(req.prompt))
        if len(req.prompt) + req.max_tokens > self.rt.n_ctx:
            raise ContextLengthError(f"the prompt ({len(req.prompt)} tokens) plus max_tokens ({req.max_tokens}) "
                                     f"exceeds the context of {self.rt.n_ctx} tokens")
        with self._lock:
            seq = _Seq(next(self._ids), req, on_event)
            self.waiting.append(seq)
            self.stats.requests_total += 1
            self._wake.notify()
            return seq.id

    def cancel(self, seq_id: int) -> None:
        """Stop a sequence at the next step and free its KV slot (e.g. its client disconnected)."""
        with self._lock:
            self.cancelled.add(seq_id)
            self._wake.notify()

    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    # -- the step --------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Prefill one ubatch, then decode. False when there was nothing to do."""
        self._drop_cancelled()
        prefilled = self._prefill_step()
        if self.running:
            self._decode()
            return True
        return prefilled

    def _drop_cancelled(self) -> None:
        with self._lock:
            if not self.cancelled:
                return
            gone, self.cancelled = self.cancelled, set()
            dropped = [s for s in self.waiting if s.id in gone]
            self.waiting = deque(s for s in self.waiting if s.id not in gone)
        if self.prefilling is not None and self.prefilling.id in gone:
            dropped.append(self.prefilling)
            self.prefilling = None
        for s in dropped + [s for s in self.running if s.id in gone]:
            self._finish(s, "cancelled")

    def _prefill_step(self) -> bool:
        if self.prefilling is None:
            with self._lock:
                if not self.waiting or not self.free_slots:
                    return False
                seq = self.waiting.popleft()
                seq.slot = self.free_slots.pop()
            seq.history = list(seq.req.prompt)
            if self._share_prefill(seq):
                return True
            self.prefilling = seq
        seq = self.prefilling
        prompt = seq.req.prompt
        chunk = prompt[seq.prefilled:seq.prefilled + self.rt.n_ubatch]
        done = seq.prefilled + len(chunk) == len(prompt)
        try:
            seq.sampler = seq.sampler or Sampler(seq.req.params)
            logits = self.rt.prefill(chunk, seq=seq.slot, start=seq.prefilled, logits=done)
        except Exception as e:   # a request that cannot run must not stop the others
            self.prefilling = None
            self._finish(seq, "error", str(e))
            return True
        seq.prefilled += len(chunk)
        if done:
            self.prefilling = None
            seq.pos = len(prompt)
            seq.prompt_logits = logits[-1]
            self.stats.prompt_tokens_total += seq.pos
            self.running.append(seq)
            self._emit_or_fail(seq, logits[-1])
        return True

    def _share_prefill(self, seq: _Seq) -> bool:
        """A running sequence with the same prompt (the n choices of one request) lends its prompt's KV cache and
        logits: copy them instead of prefilling again."""
        prompt = seq.req.prompt
        donor = next((s for s in self.running if s.prompt_logits is not None and s.req.prompt == prompt), None)
        if donor is None:
            return False
        try:
            self.rt.cache.copy_prefix(donor.slot, seq.slot, len(prompt))
            seq.sampler = Sampler(seq.req.params)
        except Exception as e:   # this sequence fails alone
            self._finish(seq, "error", f"{type(e).__name__}: {e}")
            return True
        seq.prefilled = seq.pos = len(prompt)
        seq.prompt_logits = donor.prompt_logits
        self.stats.prompt_tokens_shared += len(prompt)
        self.running.append(seq)
        self._emit_or_fail(seq, seq.prompt_logits)
        return True

    def _decode(self) -> None:
        seqs = list(self.running)
        t0 = time.perf_counter()
        try:
            logits = self.rt.decode([s.slot for s in seqs], [s.last for s in seqs], [s.pos for s in seqs])
        except Exception as e:   # the step's sequences end with the error; the loop goes on
            for s in seqs:
                self._finish(s, "error", f"{type(e).__name__}: {e}")
            return
        for s in seqs:
            s.pos += 1
        for s, row in zip(seqs, logits):
            self._emit_or_fail(s, row)
        dt = time.perf_counter() - t0
        self.stats.decode_steps += 1
        rate = len(seqs) / dt if dt > 0 else 0.0
        self.stats.tokens_per_second = rate if self.stats.decode_steps == 1 else \
            0.9 * self.stats.tokens_per_second + 0.1 * rate

    def _emit_or_fail(self, seq: _Seq, logits: np.ndarray) -> None:
        """_emit, finishing only this sequence with an error if its sampling or its event handler fails."""
        try:
            self._emit(seq, logits)
        except Exception as e:
            if seq in self.running or seq.slot >= 0:
                self._finish(seq, "error", f"{type(e).__name__}: {e}")

    def _emit(self, seq: _Seq, logits: np.ndarray) -> None:
        """Sample the next token of a running sequence from its logits, report it, finish it if it ended."""
        req = seq.req
        if seq.generated >= req.max_tokens:
            self._finish(seq, "length")
            return
        tid = seq.sampler(logits, seq.history)
        if not req.ignore_eos and self.rt.is_end_of_generation(tid):
            self._finish(seq, "stop")
            return
        event = TokenEvent(tid)
        if req.top_logprobs is not None:
            x = logits.astype(np.float64)
            lse = x.max() + np.log(np.exp(x - x.max()).sum())
            event.logprob = float(x[tid] - lse)
            if req.top_logprobs > 0:
                top = np.argsort(-x)[:req.top_logprobs]
                event.top = [(int(i), float(x[i] - lse)) for i in top]
        seq.history.append(tid)
        seq.generated += 1
        seq.last = tid
        self.stats.generated_tokens_total += 1
        seq.on_event(event)
        if seq.generated >= req.max_tokens or seq.pos >= self.rt.n_ctx:
            self._finish(seq, "length")

    def _finish(self, seq: _Seq, reason: str, error: str | None = None) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1
        self.stats.requests_finished += 1
        seq.on_event(FinishEvent(reason, len(seq.req.prompt), seq.generated, error))

    # -- the loop --------------------------------------------------------------------------------------------
    def run_in_thread(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stop or self.waiting or self.running or self.cancelled or self.prefilling):
                    self._wake.wait()
                if self._stop:
                    return
            self.step()

    def shutdown(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread:
            self._thread.join(timeout=5)
