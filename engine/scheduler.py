"""Continuous batching: each step is one forward over a token budget, then one batched sampling call.

    sched = Scheduler(runtime, max_batch_tokens=512)   # runtime built with n_seq = the number of KV slots
    sid = sched.submit(Request(prompt_ids, params, max_tokens=64), on_event)
    while sched.step(): ...

A step's batch is one token for every decoding sequence, then prefill chunks of as many admitted sequences as the
budget left holds (oldest first). Waiting requests take free KV slots as soon as there are any, all in the same
step, so a queue of prompts is prefilled together and decoding sequences keep their pace while a long prompt goes
in chunk by chunk. A request whose prompt equals a running sequence's (the n choices of one request) copies that
sequence's prompt cache and logits instead of prefilling. Requests beyond the free slots wait in a FIFO queue.

Prefix caching (on unless prefix_cache=False): a free slot keeps the tokens of the request that last used it, and a
new request takes the free slot whose tokens share the longest prefix with its prompt, or copies a longer prefix
(at least MIN_COPY_PREFIX tokens) from a running or prefilling sequence's slot, and prefills only the rest; a request
sharing such a prefix with a prompt still being prefilled waits until that prefix is in the cache (the requests
behind it go ahead). Slots are reused least recently freed first, so a cached prefix lives as long as it can.

on_event receives a TokenEvent per generated token and one FinishEvent. Every per-sequence failure (its sampling,
its event handler, copying a shared prompt) finishes that sequence with an error event; a failed forward ends the
sequences of that step; the step loop itself never stops.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .runtime import ContextLengthError, Runtime
from .sampling import Sampler, SamplingParams

MIN_COPY_PREFIX = 32     # prompt tokens worth copying from another sequence's slot (fewer are prefilled)


def common_prefix(a: np.ndarray, b: np.ndarray, limit: int) -> int:
    """How many leading tokens a and b share, at most limit."""
    m = min(len(a), len(b), limit)
    if m <= 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 128
    ignore_eos: bool = False
    top_logprobs: int | None = None     # None: no log-probs; 0: the chosen token's only; k: also the k best
    grammar: str | None = None          # structured output: an llguidance grammar (engine/grammar.py compile_grammar)
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling


@dataclass
class TokenEvent:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    cached_tokens: int = 0              # the first token's event: prompt tokens taken from the KV cache
    queue_seconds: float = 0.0          # the first token's event: from submit() until a KV slot was given


@dataclass
class FinishEvent:
    reason: str                         # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    cached_tokens: int = 0              # prompt tokens taken from the KV cache instead of prefilled


@dataclass
class _Seq:
    id: int
    req: Request
    on_event: Callable
    slot: int = -1
    pos: int = 0                       # tokens in the KV cache
    prefilled: int = 0                 # prompt tokens already in the KV cache
    cached: int = 0                    # of them, taken from a cache (a slot's earlier request, another sequence)
    prompt_ids: np.ndarray | None = None   # [len(prompt)] int32, for prefix matching
    submitted: float = 0.0             # perf_counter() at submit()
    queued: float = 0.0                # seconds from submit() until admitted
    sampler: Sampler | None = None
    constraint: object = None          # engine.grammar.Constraint when the request has a grammar
    history: list[int] = field(default_factory=list)   # prompt + generated tokens (the penalties' window)
    generated: int = 0
    last: int = -1                     # the token the next decode step feeds
    prompt_logits: object = None       # [1, n_vocab] backend logits after the prompt, kept for a sharing follower
    done: bool = False


@dataclass
class Stats:
    requests_total: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_shared: int = 0      # prompt tokens copied from a running sequence's cache instead of prefilled
    prompt_tokens_cached: int = 0      # prompt tokens found by prefix caching (a slot's tokens, or copied)
    prefix_cache_hits: int = 0         # requests that prefilled less thanks to prefix caching
    generated_tokens_total: int = 0
    steps: int = 0
    decode_steps: int = 0              # steps with decode rows only
    prefill_steps: int = 0             # steps with prefill chunks (and any decode rows)
    decode_step_seconds: float = 0.0   # wall time of those steps (forward, sampling, events)
    prefill_step_seconds: float = 0.0
    tokens_per_second: float = 0.0     # generated tokens per second over the last steps


class Scheduler:
    def __init__(self, runtime: Runtime, max_batch_tokens: int | None = None, prefix_cache: bool = True):
        self.rt = runtime
        self.max_batch_tokens = max(1, max_batch_tokens or runtime.n_ubatch)
        self.prefix_cache = prefix_cache
        self.free_slots = list(range(runtime.n_seq))     # least recently freed first
        self.slot_tokens: dict[int, np.ndarray] = {}     # free slot -> the tokens its KV cache holds
        self.waiting: deque[_Seq] = deque()
        self.prefilling: list[_Seq] = []
        self.running: list[_Seq] = []
        self.cancelled: set[int] = set()
        self.stats = Stats()
        self._ids = itertools.count(1)

    # -- requests --------------------------------------------------------------------------------------------
    def submit(self, req: Request, on_event: Callable) -> int:
        """Queue a request -> its sequence id. Raises ValueError (ContextLengthError) before queueing a bad one."""
        req.params.validate()
        self.rt.check_fits(len(req.prompt))
        if req.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if len(req.prompt) + req.max_tokens > self.rt.n_ctx:
            raise ContextLengthError(f"the prompt ({len(req.prompt)} tokens) plus max_tokens ({req.max_tokens}) "
                                     f"exceeds the context of {self.rt.n_ctx} tokens")
        n_vocab = self.rt.config.n_vocab
        if any(not 0 <= t < n_vocab for t in req.prompt):
            raise ValueError(f"a prompt token id is outside the vocabulary (0..{n_vocab - 1})")
        if req.logit_bias and any(not 0 <= t < n_vocab for t in req.logit_bias):
            raise ValueError(f"a logit_bias token id is outside the vocabulary (0..{n_vocab - 1})")
        seq = _Seq(next(self._ids), req, on_event, submitted=time.perf_counter())
        self.waiting.append(seq)
        self.stats.requests_total += 1
        return seq.id

    def cancel(self, seq_id: int) -> None:
        """Stop a sequence at the next step and free its KV slot (e.g. its client disconnected)."""
        self.cancelled.add(seq_id)

    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.cancelled)

    # -- the step --------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, run one forward over the budget, sample, report. False when there was nothing to do."""
        self._drop_cancelled()
        self._admit()
        decode = list(self.running)
        chunks = self._prefill_chunks(self.max_batch_tokens - len(decode))
        if not decode and not chunks:      # _admit took every request a free slot could: nothing is waiting on us
            return False
        self._run(decode, chunks)
        return True

    def _drop_cancelled(self) -> None:
        if not self.cancelled:
            return
        gone, self.cancelled = self.cancelled, set()
        dropped = [s for s in self.waiting if s.id in gone]
        self.waiting = deque(s for s in self.waiting if s.id not in gone)
        for s in dropped + [s for s in self.prefilling + self.running if s.id in gone]:
            self._finish(s, "cancelled")

    def _admit(self) -> None:
        """Waiting requests take free slots, oldest first (see the module's docstring): one whose prompt a running
        sequence has shares it; one whose prompt (or a long prefix of it) is being prefilled waits for that while the
        requests behind it go ahead; the others take a slot by prefix (_place)."""
        held: deque[_Seq] = deque()
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            prompt = seq.req.prompt
            if seq.prompt_ids is None:
                seq.prompt_ids = np.asarray(prompt, np.int32)
            if any(self._waits_for(seq, s) for s in self.prefilling):
                held.append(seq)
                continue
            seq.history = list(prompt)
            seq.queued = time.perf_counter() - seq.submitted
            donor = next((s for s in self.running if s.prompt_logits is not None and s.req.prompt == prompt), None)
            try:
                seq.sampler = Sampler(seq.req.params)
                if seq.req.grammar is not None:      # a copy of the grammar's kept matcher (~0.01 ms)
                    seq.constraint = self._constraint(seq.req.grammar)
                if donor is not None:
                    seq.slot = self._take_slot(self.free_slots[0])
                    self._share(seq, donor)
                    continue
                self._place(seq)
            except Exception as e:     # this sequence fails alone
                self._finish(seq, "error", f"{type(e).__name__}: {e}")
                continue
            self.prefilling.append(seq)
        self.waiting = held + self.waiting

    def _waits_for(self, seq: _Seq, other: _Seq) -> bool:
        """Whether seq should wait for other's prefill: the same prompt (its logits will be shared), or with prefix
        caching a prefix of at least MIN_COPY_PREFIX tokens other has not prefilled yet."""
        if seq.req.prompt == other.req.prompt:
            return True
        if not self.prefix_cache:
            return False
        n = common_prefix(seq.prompt_ids, other.prompt_ids, len(seq.req.prompt) - 1)
        return n >= MIN_COPY_PREFIX and other.prefilled < n

    def _place(self, seq: _Seq) -> None:
        """Give seq a free slot and the prompt tokens already in it. The free slot whose cached tokens share the
        longest prefix with the prompt is taken when nothing else it holds is lost (a conversation's next turn);
        else that prefix, or a longer one of a live sequence, is copied into the least recently freed slot when it
        is at least MIN_COPY_PREFIX tokens (the other slot keeps its tokens for a later request); else the least
        recently freed slot is taken. At least the prompt's last token is left to prefill (its logits)."""
        limit = len(seq.req.prompt) - 1
        lru = self.free_slots[0]
        slot, start, source = lru, 0, None
        if self.prefix_cache and limit > 0:
            best, best_n = lru, 0
            for s in self.free_slots:
                n = common_prefix(self.slot_tokens.get(s, seq.prompt_ids[:0]), seq.prompt_ids, limit)
                if n > best_n:
                    best, best_n = s, n
            if best_n and (best == lru or best_n == len(self.slot_tokens[best])):
                slot, start = best, best_n                              # nothing else in it is lost
            elif best_n >= MIN_COPY_PREFIX:
                start, source = best_n, best
            for other in self.prefilling + self.running:
                n = common_prefix(other.prompt_ids[:other.prefilled], seq.prompt_ids, limit)
                if n >= MIN_COPY_PREFIX and n > start:
                    slot, start, source = lru, n, other.slot
        seq.slot = self._take_slot(slot)
        if source is not None:
            self.rt.cache.copy_prefix(source, seq.slot, start)
        seq.prefilled = seq.cached = start
        if start:
            self.stats.prompt_tokens_cached += start
            self.stats.prefix_cache_hits += 1

    def _constraint(self, grammar: str):
        from .grammar import Constraint, grammar_tokenizer
        n_vocab = self.rt.config.n_vocab
        return Constraint(grammar_tokenizer(self.rt.tokenizer, n_vocab), grammar, n_vocab)

    def _take_slot(self, slot: int) -> int:
        self.free_slots.remove(slot)
        self.slot_tokens.pop(slot, None)
        return slot

    def _share(self, seq: _Seq, donor: _Seq) -> None:
        n = len(seq.req.prompt)
        self.rt.cache.copy_prefix(donor.slot, seq.slot, n)
        seq.prefilled = seq.pos = seq.cached = n
        seq.prompt_logits = donor.prompt_logits
        self.stats.prompt_tokens_shared += n
        self.running.append(seq)
        logits = self.rt.backend.rows(donor.prompt_logits, np.zeros(1, np.int32))
        self._sample_and_emit([seq], logits)

    def _prefill_chunks(self, budget: int) -> list[tuple[_Seq, int]]:
        """(sequence, tokens) prefill chunks within budget; at least a quarter of the step's budget goes to
        prefill while any is waiting, so admitted prompts always advance."""
        budget = max(budget, self.max_batch_tokens // 4, 1)
        chunks = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            take = min(len(seq.req.prompt) - seq.prefilled, budget)
            chunks.append((seq, take))
            budget -= take
        return chunks

    def _run(self, decode: list[_Seq], chunks: list[tuple[_Seq, int]]) -> None:
        tokens, positions, slots, rows = [], [], [], []
        for s in decode:
            tokens.append(s.last)
            positions.append(s.pos)
            slots.append(s.slot)
            rows.append(len(tokens) - 1)
        completing = []
        for s, take in chunks:
            a = s.prefilled
            tokens += s.req.prompt[a:a + take]
            positions += range(a, a + take)
            slots += [s.slot] * take
            if a + take == len(s.req.prompt):
                rows.append(len(tokens) - 1)
                completing.append(s)
        t0 = time.perf_counter()
        try:
            logits = self.rt.forward(tokens, positions, slots, rows)
        except Exception as e:     # the step's sequences end with the error; the loop goes on
            for s in decode + [c[0] for c in chunks]:
                self._finish(s, "error", f"{type(e).__name__}: {e}")
            return
        for s in decode:
            s.pos += 1
        for s, take in chunks:
            s.prefilled += take
        for s in completing:
            self.prefilling.remove(s)
            s.pos = len(s.req.prompt)
            self.stats.prompt_tokens_total += s.pos
            self.running.append(s)
        keep = [i for i, s in enumerate(completing) if any(w.req.prompt == s.req.prompt for w in self.waiting)]
        for i in keep:                  # a follower with the same prompt waits: keep this prompt's logits
            completing[i].prompt_logits = self.rt.backend.rows(logits, np.array([len(decode) + i], np.int32))
        self._sample_and_emit(decode + completing, logits)
        dt = time.perf_counter() - t0
        st = self.stats
        st.steps += 1
        if chunks:
            st.prefill_steps += 1
            st.prefill_step_seconds += dt
        else:
            st.decode_steps += 1
            st.decode_step_seconds += dt
        if decode:
            rate = len(decode) / dt if dt > 0 else 0.0
            st.tokens_per_second = rate if st.steps == 1 else 0.9 * st.tokens_per_second + 0.1 * rate

    def _sample_and_emit(self, seqs: list[_Seq], logits) -> None:
        """Sample one token for each sequence from its row of logits [len(seqs), n_vocab], report them. A logit bias
        and a grammar's mask (computed for all such rows at once, in llguidance's threads) are applied to the rows
        where the logits are (Backend.constrain), then every row is sampled in one batch."""
        if not seqs:
            return
        B = self.rt.backend
        # the host copies of the rows wanting log-probs, in one copy before the bias, masks and penalties change them
        need = [i for i, s in enumerate(seqs) if s.req.top_logprobs is not None]
        host = B.to_numpy(B.rows(logits, np.array(need, np.int32))) if need else None
        at = {i: j for j, i in enumerate(need)}                          # sequence index -> its row of host
        logits = self._constrain(seqs, logits)
        live = [i for i, s in enumerate(seqs) if not s.done]
        tokens = np.full(len(seqs), -1, np.int64)
        if live:
            rows = logits if len(live) == len(seqs) else B.rows(logits, np.array(live, np.int32))
            tokens[live] = self._sample_rows(rows, [seqs[i] for i in live])
        for i, (s, tid) in enumerate(zip(seqs, tokens)):
            if s.done:
                continue
            try:
                lp = host[at[i]] if s.req.top_logprobs is not None else None
                self._emit(s, int(tid), lp)
            except Exception as e:
                self._finish(s, "error", f"{type(e).__name__}: {e}")

    def _constrain(self, seqs: list[_Seq], logits):
        """logits with each sequence's logit bias added and its grammar's mask applied (Backend.constrain); a
        sequence whose grammar allows no token, or whose matcher fails, ends with an error."""
        from .grammar import any_allowed, batch_masks
        ruled = [i for i, s in enumerate(seqs) if s.constraint is not None]
        biased = [i for i, s in enumerate(seqs) if s.req.logit_bias]
        if not ruled and not biased:
            return logits
        masks = None
        if ruled:
            try:
                masks = batch_masks([seqs[i].constraint for i in ruled])
            except Exception as e:
                for i in ruled:
                    self._finish(seqs[i], "error", f"sampling failed: {type(e).__name__}: {e}")
                ruled, masks = [], None
            else:
                some = any_allowed(masks, logits.shape[1])
                for i in np.asarray(ruled)[~some]:
                    self._finish(seqs[i], "error", "sampling failed: ValueError: the grammar allows no token")
        bias = None
        if biased:
            bias = (np.concatenate([np.full(len(seqs[i].req.logit_bias), i, np.int32) for i in biased]),
                    np.concatenate([np.fromiter(seqs[i].req.logit_bias, np.int32) for i in biased]),
                    np.concatenate([np.fromiter(seqs[i].req.logit_bias.values(), np.float32) for i in biased]))
        try:
            return self.rt.backend.constrain(logits, np.asarray(ruled, np.int32), masks, bias)
        except Exception as e:
            for i in set(ruled) | set(biased):
                self._finish(seqs[i], "error", f"sampling failed: {type(e).__name__}: {e}")
            return logits

    def _sample_rows(self, logits, seqs: list[_Seq]) -> list[int]:
        """The backend's batched sampling of logits [len(seqs), n_vocab]; if it fails, each row alone, so that a
        failing sequence ends alone (-1 for it)."""
        B = self.rt.backend
        try:
            return [int(t) for t in B.sample(logits, [s.sampler for s in seqs], [s.history for s in seqs])]
        except Exception:
            tokens = []
            for i, s in enumerate(seqs):
                try:
                    row = B.rows(logits, np.array([i], np.int32))
                    tokens.append(int(B.sample(row, [s.sampler], [s.history])[0]))
                except Exception as e:
                    self._finish(s, "error", f"sampling failed: {type(e).__name__}: {e}")
                    tokens.append(-1)
            return tokens

    def _emit(self, seq: _Seq, tid: int, lp_row: np.ndarray | None) -> None:
        """Report a sequence's new token, finish it if it ended."""
        req = seq.req
        if seq.generated >= req.max_tokens:
            self._finish(seq, "length")
            return
        if not req.ignore_eos and self.rt.is_end_of_generation(tid):
            self._finish(seq, "stop")
            return
        if seq.constraint is not None:
            seq.constraint.consume(tid)                 # GrammarError: the caller ends the sequence
        first = seq.generated == 0
        event = TokenEvent(tid, cached_tokens=seq.cached if first else 0, queue_seconds=seq.queued if first else 0.0)
        if lp_row is not None:
            x = lp_row.astype(np.float64)
            lse = x.max() + np.log(np.exp(x - x.max()).sum())
            event.logprob = float(x[tid] - lse)
            if req.top_logprobs > 0:
                top = np.argsort(-x, kind="stable")[:req.top_logprobs]
                event.top = [(int(i), float(x[i] - lse)) for i in top]
        seq.history.append(tid)
        seq.generated += 1
        seq.last = tid
        self.stats.generated_tokens_total += 1
        seq.on_event(event)
        if seq.constraint is not None and seq.constraint.done:
            self._finish(seq, "stop")                   # the grammar is complete
        elif seq.generated >= req.max_tokens or seq.pos >= self.rt.n_ctx:
            self._finish(seq, "length")

    def _finish(self, seq: _Seq, reason: str, error: str | None = None) -> None:
        if seq.done:
            return
        seq.done = True
        for queue in (self.running, self.prefilling):
            if seq in queue:
                queue.remove(seq)
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            if self.prefix_cache and reason != "error":        # what the slot's KV cache holds, for a later prompt
                held = seq.history[:seq.pos] if seq.pos else seq.req.prompt[:seq.prefilled]
                if held:
                    self.slot_tokens[seq.slot] = np.asarray(held, np.int32)
            seq.slot = -1
        seq.prompt_logits = None
        self.stats.requests_finished += 1
        self.stats.requests_failed += reason == "error"
        try:
            seq.on_event(FinishEvent(reason, len(seq.req.prompt), seq.generated, error, seq.cached))
        except Exception:              # a handler that fails on its last event has nothing left to tell
            pass
