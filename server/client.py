"""The front end's side of the engine core: start the process, send requests, route its step outputs, watch it.

    engine = EngineClient(CoreConfig(...)); await engine.start()      # engine.ready is set once the core loaded
    mc = MultiChoice(engine, tokenizer, [AddRequest(...), ...], stops)
    async for delta in mc.deltas(): ...

One asyncio task reads the core's Outputs and puts each event on its request's queue; a watchdog turns a core that
exited, or that is silent past `stall_s` while requests wait on it, into EngineUnavailable for every waiting request
and every new one (the server answers 503). Detokenization and stop strings run here, per choice.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from engine.stop import StopMatcher
from engine.tokenizer import Tokenizer

from .core import CoreConfig, run_core
from .messages import Abort, AddRequest, CoreStats, Event, Fatal, Outputs, Ready, Shutdown, encoder, \
    from_core_decoder

log = logging.getLogger("engine.server")

__all__ = ["CoreConfig", "EngineClient", "EngineUnavailable", "GenerationError", "MultiChoice", "ChoiceDelta"]


MAX_TOKEN_GAPS = 4096       # token gaps kept per request for the latency histogram


class EngineUnavailable(RuntimeError):
    """The engine core is loading, failed to load, exited or stopped answering."""


class GenerationError(RuntimeError):
    """One request failed in the engine core (its message says why); status 400 when the core refused it."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class EngineClient:
    def __init__(self, cfg: CoreConfig, stall_s: float = 300.0, core_main=run_core):
        """core_main(cfg, in_addr, out_addr) is the engine-core process's main (a stand-in for benchmarks of the
        HTTP layer: scripts/bench.py http)."""
        self.cfg, self.stall_s = cfg, stall_s
        self.ready: Ready | None = None
        self.error: str | None = None            # why the core is unavailable (None: loading or ready)
        self.stats = CoreStats()
        self.queues: dict[int, tuple[asyncio.Queue, int]] = {}     # rid -> (its choice's queue, choice index)
        self._rids = itertools.count(1)
        self._last_heard = time.monotonic()
        self._dir = tempfile.mkdtemp(prefix="engine-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._push = self._sync_ctx.socket(zmq.PUSH)                 # sends never wait (NOBLOCK, a deep queue)
        self._pull = self._ctx.socket(zmq.PULL)
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._push.setsockopt(zmq.SNDHWM, 1 << 20)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull.bind(out_addr)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=core_main, args=(cfg, in_addr, out_addr), name="engine-core",
            daemon=cfg.tensor_parallel in (1, None))  # (a daemon process cannot start the other ranks' processes)
        self._tasks: list[asyncio.Task] = []

    # -- life ----------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start the core and the reader and watchdog tasks; returns at once (ready is set when the core is)."""
        self.proc.start()
        self._last_heard = time.monotonic()
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        if self.proc.is_alive():
            self._send(Shutdown())
            await asyncio.get_running_loop().run_in_executor(None, self.proc.join, 5)
            if self.proc.is_alive():
                self.proc.kill()
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
        self._sync_ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    def check(self) -> Ready:
        """The core's Ready, or EngineUnavailable."""
        if self.error:
            raise EngineUnavailable(self.error)
        if self.ready is None:
            raise EngineUnavailable("the model is loading")
        return self.ready

    # -- requests ------------------------------------------------------------------------------------------------
    def _send(self, msg) -> bool:
        try:
            self._push.send(encoder.encode(msg), zmq.NOBLOCK)
            return True
        except zmq.ZMQError:
            return False

    def submit(self, req: AddRequest, queue: asyncio.Queue, index: int = 0) -> int:
        """Send a request -> its rid (assigned here); its events arrive on queue as (index, Event)."""
        self.check()
        req.rid = next(self._rids)
        self.queues[req.rid] = (queue, index)
        if not self._send(req):
            self.queues.pop(req.rid, None)
            raise EngineUnavailable("the engine core is not reading its requests")
        return req.rid

    def abort(self, rids: list[int]) -> None:
        rids = [r for r in rids if self.queues.pop(r, None) is not None]
        if rids and self.error is None:
            self._send(Abort(rids))

    def end_streams(self, reason: str = "abort") -> None:
        """Finish every request in flight now with finish_reason `reason` (the server is shutting down); the core
        stops their sequences."""
        rids = self._finish_all(reason)
        if rids and self.error is None:
            self._send(Abort(rids))

    def _finish_all(self, finish: str, error: str | None = None) -> list[int]:
        """Give every request in flight its last event -> their ids."""
        rids = list(self.queues)
        for rid, (q, index) in self.queues.items():
            q.put_nowait((index, Event(rid, -1, finish=finish, error=error)))
        self.queues.clear()
        return rids

    @property
    def in_flight(self) -> int:
        return len(self.queues)

    # -- tasks ---------------------------------------------------------------------------------------------------
    async def _read(self) -> None:
        while True:
            msg = from_core_decoder.decode(await self._pull.recv())
            self._last_heard = time.monotonic()
            if isinstance(msg, Outputs):
                self.stats = msg.stats
                for ev in msg.events:
                    target = self.queues.get(ev.rid)
                    if target is not None:
                        target[0].put_nowait((target[1], ev))
                        if ev.finish is not None:
                            self.queues.pop(ev.rid, None)
            elif isinstance(msg, Ready):
                self.ready = msg
                log.info("model loaded on %s: context %d, parallel %d, KV cache %d blocks x %d positions (%.3g GiB)",
                         msg.device, msg.n_ctx, msg.n_seq, msg.kv_blocks, msg.kv_block_size, msg.kv_bytes / 2**30)
            elif isinstance(msg, Fatal):
                self._fail(f"the engine core failed: {msg.error}" if self.ready else
                           f"the model failed to load: {msg.error}")

    async def _watch(self) -> None:
        while self.error is None:
            await asyncio.sleep(0.25)
            if not self.proc.is_alive():
                self._fail(f"the engine core exited (code {self.proc.exitcode})" if self.ready or
                           self.proc.exitcode else "the engine core exited while loading")
            elif self.ready and self.queues and time.monotonic() - self._last_heard > self.stall_s:
                self._fail(f"the engine core has not answered for {self.stall_s:.0f} s")

    def _fail(self, why: str) -> None:
        """Every waiting request gets the error; every later one EngineUnavailable; the log says so once."""
        if self.error is None:
            self.error = why
            log.error("%s; every request is answered 503 until the server is restarted", why)
        self._finish_all("unavailable", why)


# -- one request's choices -----------------------------------------------------------------------------------------
@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    tokens: list[Event] = field(default_factory=list)    # tokens whose text this delta carries
    finish_reason: str | None = None


class MultiChoice:
    """One request's choices running in the engine core, n per prompt (choice k: prompt k // n); `deltas()` yields
    their text as it comes."""

    def __init__(self, engine: EngineClient, tok: Tokenizer, requests: list[AddRequest], stops: list[str],
                 n: int | None = None):
        self.engine, self.tok = engine, tok
        self.decoders = [tok.stream_decoder() for _ in requests]
        self.matchers = [StopMatcher(stops) for _ in requests]
        self.finished = [False] * len(requests)
        self.completion_tokens = [0] * len(requests)
        self.n = n or len(requests)                   # choices per prompt: choice k is prompt k // n's
        self.prompt_tokens = sum(len(r.prompt) for r in requests[::self.n])
        self.cached = [0] * (len(requests) // self.n)  # per prompt: tokens its first choice took from the KV cache
        self.prompt_logprobs = [None] * len(self.cached)   # per prompt: its first choice's prompt_logprobs answer
        self.queue_seconds: float | None = None       # how long the first choice waited for a KV slot
        self.merged: asyncio.Queue = asyncio.Queue()
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.token_gaps: list[float] = []             # between this request's tokens (any choice), for /metrics
        self.rids: list[int] = []
        try:
            for i, req in enumerate(requests):
                self.rids.append(engine.submit(req, self.merged, i))
        except EngineUnavailable:
            self.cancel()
            raise

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens taken from the KV cache, over the prompts."""
        return sum(self.cached)

    def cancel(self) -> None:
        self.engine.abort([rid for i, rid in enumerate(self.rids) if not self.finished[i]])

    async def deltas(self):
        try:
            while not all(self.finished):
                i, ev = await self.merged.get()
                if i % self.n == 0 and ev.prompt is not None:
                    self.prompt_logprobs[i // self.n] = ev.prompt
                if self.finished[i]:
                    continue
                if i % self.n == 0 and ev.cached:
                    self.cached[i // self.n] = ev.cached
                if i == 0 and ev.finish is None and self.queue_seconds is None:
                    self.queue_seconds = ev.queued
                if ev.finish is None:
                    now = time.monotonic()
                    if self.first_token_at is None:
                        self.first_token_at = now
                    elif len(self.token_gaps) < MAX_TOKEN_GAPS:
                        self.token_gaps.append(now - self.last_token_at)
                    self.last_token_at = now
                    self.completion_tokens[i] += 1
                    text = self.matchers[i].feed(self.decoders[i].add(ev.token))
                    if self.matchers[i].stopped:
                        self.finished[i] = True
                        self.engine.abort([self.rids[i]])
                        yield ChoiceDelta(i, text, [ev], "stop")
                    else:
                        yield ChoiceDelta(i, text, [ev])
                    continue
                self.finished[i] = True
                if ev.finish == "unavailable":
                    raise EngineUnavailable(ev.error)
                if ev.finish in ("error", "rejected"):
                    raise GenerationError(ev.error or "generation failed", 400 if ev.finish == "rejected" else 500)
                tail = self.matchers[i].feed(self.decoders[i].flush()) + self.matchers[i].flush()
                yield ChoiceDelta(i, tail, [], "stop" if ev.finish in ("stop", "cancelled") else ev.finish)
        finally:
            self.cancel()   # a client that went away frees its sequences at the next step

