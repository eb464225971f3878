"""The messages between the HTTP front end and the engine-core process (msgpack over ZeroMQ, msgspec structs).

front end -> core: AddRequest, Abort, Shutdown.
core -> front end: Ready (once, after loading) or Fatal, then Outputs: every step's events of every request in one
message, with the scheduler's counters; an idle core sends an empty Outputs each HEARTBEAT_S as a sign of life.
"""
from __future__ import annotations

import msgspec

HEARTBEAT_S = 1.0


class AddRequest(msgspec.Struct, tag=True):
    rid: int
    prompt: list[int]
    max_tokens: int
    ignore_eos: bool = False
    top_logprobs: int | None = None
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    grammar: str | None = None          # structured output: an llguidance grammar (engine/grammar.py)
    logit_bias: dict[int, float] | None = None    # token id -> added to its logit before sampling
    prompt_logprobs: int | None = None  # each prompt token's log-prob and the k best (engine.scheduler.Request)


class Abort(msgspec.Struct, tag=True):
    rids: list[int]


class Shutdown(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    n_ctx: int
    n_vocab: int
    n_seq: int
    device: str
    max_batch_tokens: int
    kv_blocks: int = 0                  # the KV cache: blocks of kv_block_size positions, kv_bytes in all
    kv_block_size: int = 0
    kv_bytes: int = 0


class Fatal(msgspec.Struct, tag=True):
    error: str


class Event(msgspec.Struct, array_like=True):
    """A token (finish None) or the end of a request (token -1)."""
    rid: int
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    finish: str | None = None           # "stop" | "length" | "cancelled" | "error" | "rejected"
    error: str | None = None
    cached: int = 0                     # prompt tokens the request took from the KV cache (first token, end)
    queued: float = 0.0                 # first token: seconds the request waited for a KV slot in the core
    prompt: list[tuple[float, list[tuple[int, float]] | None] | None] | None = None   # first: prompt_logprobs


class SlotState(msgspec.Struct, array_like=True):
    """A busy KV slot at the last step: the request in it, its prompt tokens, how many came from a cache, the tokens
    generated so far, and the tokens the slot's cache holds."""
    id: int
    request: int = -1
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0
    n_past: int = 0


class CoreStats(msgspec.Struct, array_like=True):
    requests_total: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    running: int = 0
    waiting: int = 0
    prompt_tokens_total: int = 0
    prompt_tokens_shared: int = 0
    generated_tokens_total: int = 0
    steps: int = 0
    tokens_per_second: float = 0.0
    kv_slots_free: int = 0
    prefill_steps: int = 0
    decode_step_seconds: float = 0.0
    prefill_step_seconds: float = 0.0
    prompt_tokens_cached: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    kv_blocks: int = 0
    kv_blocks_held: int = 0             # blocks sequences hold (the rest are free or cached)
    slots: list[SlotState] = msgspec.field(default_factory=list)


class Outputs(msgspec.Struct, tag=True):
    events: list[Event]
    stats: CoreStats


ToCore = AddRequest | Abort | Shutdown
FromCore = Ready | Fatal | Outputs

encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)
