"""Continuous batching: each step is one forward over a token budget, then one batched sampling call.

    sched = Scheduler(runtime, max_batch_tokens=512)   # runtime built with n_seq = the number of KV slots
    sid = sched.submit(Request(prompt_ids, params, max_tokens=64), on_event)
    while sched.step(): ...

A step's batch is one token for every decoding sequence, then prefill chunks of as many admitted sequences as the
budget left holds (oldest first). Waiting requests are admitted as soon as a sequence slot (runtime.n_seq of them)
and KV blocks for their prompt are free, all in the same step, so a queue of prompts is prefilled together and
decoding sequences keep their pace while a long prompt goes in chunk by chunk. A request whose prompt equals a running
sequence's (the n choices of one request) shares that sequence's prompt cache and logits instead of prefilling.
Requests that do not fit wait in a FIFO queue.

KV memory is in blocks (engine/kv_blocks.py): a sequence holds the blocks of its prompt from admission on and one more
each time its decoding starts a block. When a decoding sequence needs a block and none is free, the sequences
admitted last are preempted: their blocks are released (and stay cached), and they wait at the front of the queue to
be recomputed (their prompt and the tokens generated so far prefilled again, mostly from the cache) and go on where
they were, with the same sampler and grammar.

Prefix caching (on unless prefix_cache=False): a new request shares the cached full blocks holding its prompt's
longest prefix, then takes over or copies (at least min_copy tokens) the block holding most of what follows, and
prefills only the rest; a request whose prompt shares with one still being prefilled at least MIN_COPY_PREFIX tokens
that one has yet to compute waits until they are in the cache (the requests behind it go ahead); fewer, as where a
burst shares a cached system prompt and a token or two past it, are not worth a step's wait. Released blocks are reused
least recently released first, so a cached prefix lives as long as it can.

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

from .kv_blocks import BlockManager, common_prefix
from .runtime import ContextLengthError, Runtime
from .sampling import Sampler, SamplingParams

MIN_COPY_PREFIX = 32     # prompt tokens worth copying into a whole-context block (fewer are prefilled); a paged
                         # cache copies any (a block's copy is cheaper than prefilling its tokens)
WATERMARK = 0.01         # of a paged cache's blocks, kept free at admission for decoding sequences


@dataclass
class Request:
    prompt: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 128
    ignore_eos: bool = False
    top_logprobs: int | None = None     # None: no log-probs; 0: the chosen token's only; k: also the k best
    grammar: str | None = None          # structured output: an llguidance grammar (engine/grammar.py compile_grammar)
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit before sampling
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's log-prob after the ones before it and
                                        # the k best there (the first event's prompt_logprobs; the prompt is
                                        # prefilled whole, no cache)


def token_logprobs(x: np.ndarray, tid: int, k: int) -> tuple[float, list[tuple[int, float]] | None]:
    """A row of logits -> (token tid's log-prob, the k most likely tokens' (id, log-prob), None for k = 0)."""
    x = x.astype(np.float64)
    lse = x.max() + np.log(np.exp(x - x.max()).sum())
    top = None
    if k > 0:     # the first k of a stable descending sort, sorting only the values tied with the k-th or above
        kth = np.partition(x, len(x) - k)[len(x) - k]                 # (a whole sort: ~7 ms a row of 49,152)
        cand = np.arange(len(x)) if np.isnan(kth) else np.flatnonzero(x >= kth)
        top = [(int(i), float(x[i] - lse)) for i in cand[np.argsort(-x[cand], kind="stable")[:k]]]
    return float(x[tid] - lse), top


@dataclass
class TokenEvent:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    cached_tokens: int = 0              # the first token's event: prompt tokens taken from the KV cache
    queue_seconds: float = 0.0          # the first token's event: from submit() until it was admitted
    prompt_logprobs: list | None = None  # the first token's event: Request.prompt_logprobs' answer (FinishEvent's)


@dataclass
class FinishEvent:
    reason: str                         # "stop" | "length" | "cancelled" | "error"
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    cached_tokens: int = 0              # prompt tokens taken from the KV cache instead of prefilled
    prompt_logprobs: list | None = None  # Request.prompt_logprobs, when no token came: [(log-prob, top)] of prompt
                                         # tokens 1.. (None where not computed: the request ended first)


def same_prompt(a: list[int], b: list[int]) -> bool:
    """a == b, the lengths and last tokens first (a burst's prompts share a long system text and part at the end: the
    whole comparison walked the shared text for every pair)."""
    return len(a) == len(b) and (not a or a[-1] == b[-1]) and a == b


@dataclass(eq=False)                   # one sequence is itself only: list membership and removal by identity
class _Seq:
    id: int
    req: Request
    on_event: Callable
    slot: int = -1                     # its place among the runtime's n_seq sequences in flight (-1: none)
    blocks: list[int] = field(default_factory=list)   # its KV blocks, in order (engine/kv_blocks.py)
    fill: list[int] | None = None      # the tokens to prefill: the prompt, or a preempted sequence's cache
    resumed: bool = False              # fill is a preempted sequence's: no token is sampled when it is in
    order: int = -1                    # admission order (the last admitted are preempted first)
    pos: int = 0                       # tokens in the KV cache
    prefilled: int = 0                 # tokens of fill already in the KV cache
    cached: int = 0                    # of the prompt's, taken from a cache (an earlier request, another sequence)
    prompt_ids: np.ndarray | None = None   # [len(fill)] int32, for prefix matching
    submitted: float = 0.0             # perf_counter() at submit()
    queued: float = -1.0               # seconds from submit() until admitted (-1: not yet)
    sampler: Sampler | None = None
    constraint: object = None          # engine.grammar.Constraint when the request has a grammar
    history: list[int] = field(default_factory=list)   # prompt + generated tokens (the penalties' window)
    generated: int = 0
    last: int = -1                     # the token the next decode step feeds
    prompt_logits: object = None       # [1, n_vocab] backend logits after the prompt, kept for a sharing follower
    prompt_lp: list | None = None      # Request.prompt_logprobs' answer: entry p - 1 for prompt token p (None until
                                       # prefilled)
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
    preemptions: int = 0               # sequences preempted for KV blocks (and recomputed)
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
        self.block_size = runtime.block_size
        self.blocks = BlockManager(runtime.n_blocks, runtime.block_size, caching=prefix_cache)
        self.paged = runtime.block_size < runtime.n_ctx            # else one block of a whole context per sequence
        self.min_copy = 1 if self.paged else MIN_COPY_PREFIX
        self.watermark = int(WATERMARK * runtime.n_blocks) if self.paged else 0
        self.free_slots = list(range(runtime.n_seq))     # least recently freed first
        self.waiting: deque[_Seq] = deque()
        self.prefilling: list[_Seq] = []
        self.running: list[_Seq] = []
        self.cancelled: set[int] = set()
        self.stats = Stats()
        self._ids = itertools.count(1)
        self._order = itertools.count()

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
        try:                                    # once here, for the check and the prefix matching (a 2,000-token
            ids = np.asarray(req.prompt, np.int64)          # prompt: ~0.08 ms, its Python loop took ~0.18)
        except (OverflowError, TypeError, ValueError):
            ids = None
        if ids is None or ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= n_vocab)):
            raise ValueError(f"a prompt token id is outside the vocabulary (0..{n_vocab - 1})")
        if req.logit_bias and any(not 0 <= t < n_vocab for t in req.logit_bias):
            raise ValueError(f"a logit_bias token id is outside the vocabulary (0..{n_vocab - 1})")
        seq = _Seq(next(self._ids), req, on_event, submitted=time.perf_counter())
        seq.prompt_ids = ids.astype(np.int32)
        if req.prompt_logprobs is not None:
            seq.prompt_lp = [None] * (len(req.prompt) - 1)
        self.waiting.append(seq)
        self.stats.requests_total += 1
        return seq.id

    def cancel(self, seq_id: int) -> None:
        """Stop a sequence at the next step and free its KV blocks (e.g. its client disconnected)."""
        self.cancelled.add(seq_id)

    @property
    def queue_length(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self.cancelled)

    # -- the step --------------------------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, give decoding sequences their next block, run one forward over the budget, sample, report. False
        when there was nothing to do."""
        self._drop_cancelled()
        self._admit()
        self._grow()
        decode = list(self.running)
        chunks = self._prefill_chunks(self.max_batch_tokens - len(decode))
        if not decode and not chunks:      # _admit took every request that fits: nothing is waiting on us
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
        """Waiting requests are admitted oldest first while a slot and their blocks are free (see the module's
        docstring): one whose prompt a running sequence has shares it; one whose prompt (or a long prefix of it) is
        being prefilled waits for that while the requests behind it go ahead; the others are placed by prefix
        (_place). The first that does not fit in the free blocks stops admission (the queue keeps its order)."""
        held: deque[_Seq] = deque()
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            if seq.fill is None:
                seq.fill = list(seq.req.prompt)         # (prompt_ids: made by submit)
            if not seq.resumed and any(self._waits_for(seq, s) for s in self.prefilling):
                held.append(seq)
                continue
            try:
                if seq.sampler is None:
                    seq.history = list(seq.req.prompt)
                    seq.sampler = Sampler(seq.req.params)
                    if seq.req.grammar is not None:      # a copy of the grammar's kept matcher (~0.01 ms)
                        seq.constraint = self._constraint(seq.req.grammar)
                prompt = seq.req.prompt
                donor = None if seq.resumed or seq.req.prompt_logprobs is not None else next(
                    (s for s in self.running if s.prompt_logits is not None and same_prompt(s.req.prompt, prompt)),
                    None)
                placed = self._share(seq, donor) if donor is not None else self._place(seq)
            except Exception as e:     # this sequence fails alone
                self._finish(seq, "error", f"{type(e).__name__}: {e}")
                continue
            if not placed:             # its blocks are not free: it waits at the front
                self.waiting.appendleft(seq)
                break
            if donor is None:
                (self.running if seq.prefilled == len(seq.fill) else self.prefilling).append(seq)
        self.waiting = held + self.waiting

    def _waits_for(self, seq: _Seq, other: _Seq) -> bool:
        """Whether seq should wait for other's prefill: the same prompt (its logits will be shared), or with prefix
        caching at least MIN_COPY_PREFIX tokens of their common prefix that other has not prefilled yet (what other
        has prefilled, seq finds in the cache now)."""
        if not other.resumed and same_prompt(seq.req.prompt, other.req.prompt):
            return True
        limit = len(seq.fill) - 1
        if not self.prefix_cache or limit - other.prefilled < MIN_COPY_PREFIX:   # too little left to wait for (a
            return False                                                           # burst past a cached prompt)
        n = common_prefix(seq.prompt_ids, other.prompt_ids, limit)
        return n - other.prefilled >= MIN_COPY_PREFIX

    def _reserve(self) -> int:
        """Free blocks admission leaves alone: the watermark, and one for each decoding sequence about to start
        a block (none while no sequence is in: a prompt that fits the whole cache is let in)."""
        if not self.paged or not (self.running or self.prefilling):
            return 0
        bs = self.block_size
        return self.watermark + sum(s.pos == len(s.blocks) * bs for s in self.running)

    def _place(self, seq: _Seq) -> bool:
        """Give seq a slot and blocks for its fill, the cached ones holding its longest prefix first -> False (and
        nothing taken) when the free blocks do not hold it. After the shared full blocks, the block holding most of
        the next tokens is taken over when nobody holds it and nothing else in it is lost (all it holds is wanted,
        or it is the next to be reused anyway), else those tokens are copied into a new block when there are at
        least min_copy of them. A new prompt leaves at least its last token to prefill (its logits)."""
        B, bs = self.blocks, self.block_size
        limit = len(seq.fill) - (0 if seq.resumed else 1)
        cache = self.prefix_cache and seq.req.prompt_logprobs is None      # (prompt log-probs: every token computed)
        shared, cand, n = B.match(seq.prompt_ids, limit) if cache else ([], -1, 0)
        take = n > 0 and B.ref[cand] == 0 and (n == B.length[cand] or cand == B.next_free())
        copy = not take and n >= self.min_copy
        n = n if take or copy else 0
        needed = -(-len(seq.fill) // bs)
        leaving = needed - len(shared) + int(np.count_nonzero(B.ref[shared] == 0))   # new blocks, cached ones held
        if leaving + self._reserve() > B.n_free:
            return False
        B.hold_all(shared)
        table = list(shared)
        if take:
            B.hold(cand)
            B.truncate(cand, n)
            table.append(cand)
        elif copy:
            table.append(self._copied(cand, n))
        while len(table) < needed:
            table.append(B.allocate())
        start = len(shared) * bs + n
        self._admitted(seq, table)
        seq.prefilled = start
        if not seq.resumed:
            seq.cached = start
            if start:
                self.stats.prompt_tokens_cached += start
                self.stats.prefix_cache_hits += 1
        if seq.prefilled == len(seq.fill):        # a preempted sequence whose cache was all still there
            seq.pos, seq.resumed = len(seq.fill), False
        return True

    def _copied(self, src: int, n: int) -> int:
        """A new block holding the first n positions of block src."""
        b = self.blocks.allocate()
        self.rt.cache.copy_prefix(src, b, n)
        self.blocks.copy(src, b, n)
        return b

    def _admitted(self, seq: _Seq, table: list[int]) -> None:
        seq.blocks = table
        seq.slot = self.free_slots.pop(0)
        if seq.order < 0:
            seq.order = next(self._order)
        if seq.queued < 0:
            seq.queued = time.perf_counter() - seq.submitted

    def _constraint(self, grammar: str):
        from .grammar import Constraint, grammar_tokenizer
        n_vocab = self.rt.config.n_vocab
        return Constraint(grammar_tokenizer(self.rt.tokenizer, n_vocab), grammar, n_vocab)

    def _share(self, seq: _Seq, donor: _Seq) -> bool:
        """seq has donor's prompt: its full blocks shared, the rest copied, its logits sampled -> False (nothing
        taken) when no block is free for the copy."""
        B, bs = self.blocks, self.block_size
        n = len(seq.req.prompt)
        full, part = divmod(n, bs)
        if (part > 0) + self._reserve() > B.n_free:
            return False
        B.hold_all(donor.blocks[:full])
        self._admitted(seq, donor.blocks[:full] + ([self._copied(donor.blocks[full], part)] if part else []))
        seq.prefilled = seq.pos = seq.cached = n
        seq.prompt_logits = donor.prompt_logits
        self.stats.prompt_tokens_shared += n
        self.running.append(seq)
        logits = self.rt.backend.rows(donor.prompt_logits, np.zeros(1, np.int32))
        self._sample_and_emit([seq], logits)
        return True

    def _grow(self) -> None:
        """Every decoding sequence whose next position starts a block gets a new one; while none is free, the
        sequences admitted last are preempted (the one needing the block among them)."""
        if not self.paged:                 # a whole context's block: never outgrown
            return
        B, bs = self.blocks, self.block_size
        for seq in list(self.running):
            if seq.pos < len(seq.blocks) * bs or seq not in self.running:
                continue
            while B.n_free == 0:
                victim = max(self.prefilling + self.running, key=lambda s: s.order)
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                b = B.allocate()
                B.write(b, B.parent_of(seq.blocks, len(seq.blocks)), 0, [])
                seq.blocks.append(b)

    def _preempt(self, seq: _Seq) -> None:
        """Release seq's blocks and slot; it waits at the front of the queue to be recomputed (a decoding sequence's
        fill becomes the tokens its cache held)."""
        self._release(seq)
        if seq in self.running:
            self.running.remove(seq)
            seq.fill = seq.history[:seq.pos]
            seq.prompt_ids = np.asarray(seq.fill, np.int32)
            seq.resumed = True
        else:
            self.prefilling.remove(seq)
        seq.prefilled = 0
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1

    def _release(self, seq: _Seq) -> None:
        B = self.blocks
        if not self.paged and seq.blocks and seq.pos > B.length[seq.blocks[0]]:   # its generated tokens (_run)
            n = int(B.length[seq.blocks[0]])
            self._record(seq, n, seq.history[n:seq.pos])
        for b in seq.blocks:
            B.release(b)
        seq.blocks = []
        if seq.slot >= 0:
            self.free_slots.append(seq.slot)
            seq.slot = -1

    def _record(self, seq: _Seq, start: int, tokens) -> None:
        """The blocks of seq now hold tokens at positions start.. (after a forward wrote them)."""
        B, bs = self.blocks, self.block_size
        i = 0
        while i < len(tokens):
            p = start + i
            j, off = divmod(p, bs)
            k = min(bs - off, len(tokens) - i)
            B.write(seq.blocks[j], B.parent_of(seq.blocks, j), off, tokens[i:i + k])
            i += k

    def _record_decode(self, decode: list[_Seq]) -> None:
        """The decode rows' tokens are in their blocks (after the forward wrote them); each sequence one further."""
        if not decode:
            return
        bs, n = self.block_size, len(decode)
        blocks = np.fromiter((s.blocks[s.pos // bs] for s in decode), np.int64, n)
        offsets = np.fromiter((s.pos % bs for s in decode), np.int64, n)
        self.blocks.append(blocks, offsets, np.fromiter((s.last for s in decode), np.int32, n))
        for s in decode:
            s.pos += 1

    def _prefill_chunks(self, budget: int) -> list[tuple[_Seq, int]]:
        """(sequence, tokens) prefill chunks within budget; at least a quarter of the step's budget goes to
        prefill while any is waiting, so admitted prompts always advance."""
        budget = max(budget, self.max_batch_tokens // 4, 1)
        chunks = []
        for seq in self.prefilling:
            if budget <= 0:
                break
            take = min(len(seq.fill) - seq.prefilled, budget)
            chunks.append((seq, take))
            budget -= take
        return chunks

    def _run(self, decode: list[_Seq], chunks: list[tuple[_Seq, int]]) -> None:
        tokens, positions, seqs, rows = [], [], [], []
        tables = {s.id: s.blocks for s in decode}
        for s in decode:
            tokens.append(s.last)
            positions.append(s.pos)
            seqs.append(s.id)
            rows.append(len(tokens) - 1)
        completing, resumed = [], []
        scored = []                                 # (sequence, prompt position, row) whose next prompt token's
        for s, take in chunks:                      # log-prob the request asks for (rows past the sampled ones)
            a = s.prefilled
            if s.req.prompt_logprobs is not None and not s.resumed:
                scored += [(s, p, len(tokens) + p - a) for p in range(a, min(a + take, len(s.req.prompt) - 1))]
            tokens += s.fill[a:a + take]
            positions += range(a, a + take)
            seqs += [s.id] * take
            tables[s.id] = s.blocks
            if a + take == len(s.fill):
                if s.resumed:                       # back where it was: its next token is already drawn
                    resumed.append(s)
                else:
                    rows.append(len(tokens) - 1)
                    completing.append(s)
        t0 = time.perf_counter()
        try:
            logits = self.rt.forward(tokens, positions, seqs, rows + [r for _, _, r in scored], tables)
            if scored:
                logits = self._score_prompts(logits, len(rows), scored)
        except Exception as e:     # the step's sequences end with the error; the loop goes on
            for s in decode + [c[0] for c in chunks]:
                self._finish(s, "error", f"{type(e).__name__}: {e}")
            return
        if self.paged:
            self._record_decode(decode)
        else:                               # a whole-context block learns its generated tokens when released
            for s in decode:
                s.pos += 1
        for s, take in chunks:
            self._record(s, s.prefilled, s.fill[s.prefilled:s.prefilled + take])
            s.prefilled += take
        for s in resumed:
            self.prefilling.remove(s)
            s.pos, s.resumed = len(s.fill), False
            self.running.append(s)
        for s in completing:
            self.prefilling.remove(s)
            s.pos = len(s.req.prompt)
            self.stats.prompt_tokens_total += s.pos
            self.running.append(s)
        keep = [i for i, s in enumerate(completing)
                if any(same_prompt(w.req.prompt, s.req.prompt) for w in self.waiting)]
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

    def _score_prompts(self, logits, n_rows: int, scored: list):
        """The log-probs of prompt tokens asked for (Request.prompt_logprobs) from logits rows n_rows.. (in scored's
        order) -> the first n_rows rows, to sample from."""
        B = self.rt.backend
        host = B.to_numpy(B.rows(logits, np.arange(n_rows, n_rows + len(scored), dtype=np.int32)))
        for (s, p, _), x in zip(scored, host):
            s.prompt_lp[p] = token_logprobs(x, s.req.prompt[p + 1], s.req.prompt_logprobs)
        return B.rows(logits, np.arange(n_rows, dtype=np.int32)) if n_rows else None

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
        event = TokenEvent(tid, cached_tokens=seq.cached if first else 0, queue_seconds=seq.queued if first else 0.0,
                           prompt_logprobs=seq.prompt_lp if first else None)
        if lp_row is not None:
            event.logprob, event.top = token_logprobs(lp_row, tid, req.top_logprobs)
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
        self._release(seq)                    # its blocks stay cached for a later prompt (with prefix caching)
        seq.prompt_logits = None
        self.stats.requests_finished += 1
        self.stats.requests_failed += reason == "error"
        try:
            seq.on_event(FinishEvent(reason, len(seq.req.prompt), seq.generated, error, seq.cached,
                                     seq.prompt_lp if seq.generated == 0 else None))
        except Exception:              # a handler that fails on its last event has nothing left to tell
            pass
