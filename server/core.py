"""The engine-core process: the scheduler, the runtime and the GPU, in a loop that waits on nothing but its inputs.

    python -m server.core is not a command: server/client.py starts `run_core(config, in_addr, out_addr)` in a
    spawned process. Each turn of the loop takes every message waiting on its input socket, runs one scheduler step
    when there is work, and sends that step's events of every request as one Outputs message. Idle, it blocks on
    the input socket and sends an empty Outputs every HEARTBEAT_S.
"""
from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

import zmq

from .messages import (HEARTBEAT_S, Abort, AddRequest, CoreStats, Event, Fatal, Outputs, Ready, Shutdown, SlotState,
                       encoder, to_core_decoder)


@dataclass
class CoreConfig:
    model: str
    device: str = "auto"
    n_parallel: int | None = None              # None: default_parallel()
    n_ctx: int | None = None
    n_ubatch: int = 512
    max_batch_tokens: int | None = None
    kv_f32: bool = False
    warmup: bool = True
    prefix_cache: bool = True
    kv_memory: float | None = None             # bytes of KV cache (a paged cache; None: n_parallel whole contexts)
    kv_type: str | None = None                 # the KV cache's type when not the backend's (Runtime's kv_type)
    cuda: object = None                        # engine.cuda.config.CudaConfig (None: the defaults)
    tensor_parallel: object = 1                # ranks the model is split over: a count or a ParallelConfig
    batch_invariant: bool = False              # a sequence's logits independent of its batch (Runtime)


def run_core(cfg: CoreConfig, in_addr: str, out_addr: str) -> None:
    """The process's main: load, report Ready (or Fatal), then serve until Shutdown or the front end goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C goes to the front end, which shuts us down
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(in_addr)
    push.connect(out_addr)
    push.setsockopt(zmq.LINGER, 1000)
    try:
        core = EngineCore(cfg)
    except Exception as e:     # a bad file, no GPU, out of memory: the front end answers 503 with this
        push.send(encoder.encode(Fatal(f"{type(e).__name__}: {e}")))
        push.close()
        ctx.term()
        return
    push.send(encoder.encode(core.ready()))
    try:
        core.serve(pull, push)
    finally:
        pull.close(0)
        push.close()
        ctx.term()


MAX_DEFAULT_PARALLEL = 64
CPU_DEFAULT_PARALLEL = 4


def default_parallel(cfg: CoreConfig) -> int:
    """KV slots when --parallel is not given: 4 on the CPU; on a GPU as many as 90 % of the memory left after the
    weights holds, at most 64."""
    from engine.backends import cuda_available
    from engine.gguf import GGUFFile
    from engine.hub import resolve_model
    from engine.model.config import ModelConfig
    from engine.runtime import DEFAULT_CTX

    if cfg.device == "cpu" or (cfg.device == "auto" and not cuda_available()):
        return CPU_DEFAULT_PARALLEL
    import cupy
    f = GGUFFile(resolve_model(cfg.model))
    c = ModelConfig.from_gguf(f)
    n_ctx = cfg.n_ctx or min(DEFAULT_CTX, c.n_ctx_train)
    from engine.parallel.config import ParallelConfig
    tp = ParallelConfig.of(cfg.tensor_parallel).size
    n_kv = -(-c.n_head_kv // tp)                                          # a rank's KV heads (at most)
    per_slot = 2 * c.n_layer * n_ctx * n_kv * c.head_dim * (4 if cfg.kv_f32 else 2)
    free, _ = cupy.cuda.runtime.memGetInfo()
    room = 0.9 * free - f.file_size / tp
    return max(1, min(MAX_DEFAULT_PARALLEL, int(room // per_slot) - 1))


def warm_up(rt, max_batch_tokens: int) -> None:
    """Run one step of every shape rt's backend names for a step budget of max_batch_tokens (compiling kernels,
    capturing CUDA graphs) and one batched sampling call, so no request waits for the compiler or a capture."""
    from engine.sampling import Sampler, SamplingParams

    sampled = False
    for n_decode, n_prefill in rt.backend.warm_up_shapes(rt.n_seq, max_batch_tokens):
        n_prefill = min(n_prefill, rt.n_ctx - 1)
        tokens = [1] * (n_decode + n_prefill)
        positions = [n_prefill] * n_decode + list(range(n_prefill))
        seqs = list(range(n_decode)) + [n_decode] * n_prefill          # distinct sequences (n_decode < n_seq)
        rows = list(range(n_decode)) + ([len(tokens) - 1] if n_prefill else [])
        logits = rt.forward(tokens, positions, seqs, rows, rt.scratch_tables(seqs, n_prefill + 1))
        if not sampled and len(rows) > 1:
            params = SamplingParams(temperature=1.0, top_k=40, top_p=0.9)
            rt.backend.sample(logits, [Sampler(params) for _ in rows], [[1] for _ in rows])
            sampled = True
    sync = getattr(rt.backend, "synchronize", None)
    if sync:
        sync()


class EngineCore:
    def __init__(self, cfg: CoreConfig):
        from engine.runtime import Runtime
        from engine.scheduler import Scheduler

        self.cfg = cfg
        n_seq = cfg.n_parallel or default_parallel(cfg)
        self.rt = Runtime.load(cfg.model, device=cfg.device, n_ctx=cfg.n_ctx, n_seq=n_seq,
                               n_ubatch=cfg.n_ubatch, kv_f32=cfg.kv_f32, cuda=cfg.cuda,
                               tensor_parallel=cfg.tensor_parallel, kv_memory=cfg.kv_memory,
                               kv_type=cfg.kv_type, batch_invariant=cfg.batch_invariant)
        self.sched = Scheduler(self.rt, cfg.max_batch_tokens, cfg.prefix_cache)
        self.seq_of: dict[int, int] = {}          # request id -> scheduler sequence id
        self.events: list[Event] = []
        if cfg.warmup:
            warm_up(self.rt, self.sched.max_batch_tokens)
        threading.Thread(target=self._grammar_tokenizer, daemon=True).start()   # ahead of the first grammar

    def _grammar_tokenizer(self) -> None:
        """Build the structured-output tokenizer (engine/grammar.py; cached) before a request needs it."""
        from engine.grammar import grammar_tokenizer
        try:
            grammar_tokenizer(self.rt.tokenizer, self.rt.config.n_vocab)
        except Exception:              # llguidance missing, a vocabulary it refuses: a grammar request says so
            pass

    def ready(self) -> Ready:
        rt = self.rt
        kv_bytes = rt.n_blocks * rt.block_size * rt.model.kv_bytes_per_token(rt.kv_type)
        return Ready(rt.n_ctx, rt.config.n_vocab, rt.n_seq, rt.backend.name, self.sched.max_batch_tokens,
                     rt.n_blocks, rt.block_size, int(kv_bytes))

    # -- the loop ----------------------------------------------------------------------------------------------
    def serve(self, pull, push) -> None:
        parent = os.getppid()
        last_sent = time.monotonic()
        while True:
            busy = self.sched.has_work
            if pull.poll(0 if busy else int(HEARTBEAT_S * 1000)):
                while True:
                    try:
                        raw = pull.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if not self.handle(to_core_decoder.decode(raw)):
                        return
            if self.sched.has_work:
                self.sched.step()
            failure = self.rt.backend.failure
            now = time.monotonic()
            if self.events or failure or now - last_sent >= HEARTBEAT_S:
                if os.getppid() != parent:          # the front end died: nobody reads us
                    return
                push.send(encoder.encode(Outputs(self.events, self.stats())))
                self.events = []
                last_sent = now
            if failure:                             # no later step can run: the front end answers 503 from now
                push.send(encoder.encode(Fatal(failure)))
                return

    def handle(self, msg) -> bool:
        """One message from the front end; False on Shutdown."""
        if isinstance(msg, AddRequest):
            self.add(msg)
        elif isinstance(msg, Abort):
            for rid in msg.rids:
                sid = self.seq_of.get(rid)
                if sid is not None:
                    self.sched.cancel(sid)
        elif isinstance(msg, Shutdown):
            return False
        return True

    def add(self, msg: AddRequest) -> None:
        from engine.sampling import SamplingParams
        from engine.scheduler import Request

        try:
            params = SamplingParams(temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, min_p=msg.min_p,
                                    repeat_penalty=msg.repeat_penalty, repeat_last_n=msg.repeat_last_n,
                                    presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
                                    seed=msg.seed)
            req = Request(msg.prompt, params, msg.max_tokens, msg.ignore_eos, msg.top_logprobs, msg.grammar,
                          msg.logit_bias, msg.prompt_logprobs)
            self.seq_of[msg.rid] = self.sched.submit(req, self._on_event(msg.rid))
        except Exception as e:     # the front end validated first; this is the last word
            self.events.append(Event(msg.rid, -1, finish="rejected", error=f"{type(e).__name__}: {e}"))

    def _on_event(self, rid: int):
        from engine.scheduler import FinishEvent

        def on_event(ev) -> None:
            if isinstance(ev, FinishEvent):
                self.seq_of.pop(rid, None)
                self.events.append(Event(rid, -1, finish=ev.reason, error=ev.error, cached=ev.cached_tokens,
                                         prompt=ev.prompt_logprobs))
            else:
                self.events.append(Event(rid, ev.token, ev.logprob, ev.top, cached=ev.cached_tokens,
                                         queued=ev.queue_seconds, prompt=ev.prompt_logprobs))
        return on_event

    def stats(self) -> CoreStats:
        s, st = self.sched, self.sched.stats
        return CoreStats(st.requests_total, st.requests_finished, st.requests_failed, len(s.running) +
                         len(s.prefilling), s.queue_length, st.prompt_tokens_total, st.prompt_tokens_shared,
                         st.generated_tokens_total, st.steps, round(st.tokens_per_second, 3), len(s.free_slots),
                         st.prefill_steps, st.decode_step_seconds, st.prefill_step_seconds, st.prompt_tokens_cached,
                         st.prefix_cache_hits, st.preemptions, s.blocks.n_blocks, s.blocks.n_blocks - s.blocks.n_free,
                         self.slot_states())

    def slot_states(self) -> list[SlotState]:
        """The busy KV slots and the request in each (llama-server's /slots; the front end adds the free ones): built
        every step, so only for the sequences there are."""
        busy = (*self.sched.prefilling, *self.sched.running)
        if not busy:
            return []
        rid_of = {seq: rid for rid, seq in self.seq_of.items()}
        return [SlotState(seq.slot, rid_of.get(seq.id, -1), len(seq.prompt_ids), seq.cached, seq.generated, seq.pos)
                for seq in busy if seq.slot >= 0]
