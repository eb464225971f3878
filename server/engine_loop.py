"""The async side of the scheduler: submit the n choices of a request, stream their text back to the event loop."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from engine.scheduler import FinishEvent, Request, Scheduler, TokenEvent
from engine.stop import StopMatcher
from engine.tokenizer import Tokenizer


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    tokens: list[TokenEvent] = field(default_factory=list)   # tokens whose text this delta carries
    finish_reason: str | None = None


class GenerationError(RuntimeError):
    pass


class MultiChoice:
    """One request's n choices running in the scheduler; `deltas()` yields their text as it comes."""

    def __init__(self, sched: Scheduler, tok: Tokenizer, requests: list[Request], stops: list[str]):
        self.sched, self.tok = sched, tok
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.decoders = [tok.stream_decoder() for _ in requests]
        self.matchers = [StopMatcher(stops) for _ in requests]
        self.finished = [False] * len(requests)
        self.completion_tokens = [0] * len(requests)
        self.prompt_tokens = len(requests[0].prompt)
        self.seq_ids = []
        for i, req in enumerate(requests):   # submit raises ContextLengthError / ValueError before anything runs
            self.seq_ids.append(sched.submit(req, self._callback(i)))

    def _callback(self, i):
        def on_event(ev):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, ev))
        return on_event

    def cancel(self) -> None:
        for i, sid in enumerate(self.seq_ids):
            if not self.finished[i]:
                self.sched.cancel(sid)

    async def deltas(self):
        try:
            while not all(self.finished):
                i, ev = await self.queue.get()
                if self.finished[i]:
                    continue
                if isinstance(ev, TokenEvent):
                    self.completion_tokens[i] += 1
                    text = self.matchers[i].feed(self.decoders[i].add(ev.token))
                    if self.matchers[i].stopped:
                        self.finished[i] = True
                        self.sched.cancel(self.seq_ids[i])
                        yield ChoiceDelta(i, text, [ev], "stop")
                    else:
                        yield ChoiceDelta(i, text, [ev])
                elif isinstance(ev, FinishEvent):
                    self.finished[i] = True
                    if ev.reason == "error":
                        raise GenerationError(ev.error or "generation failed")
                    tail = self.matchers[i].feed(self.decoders[i].flush()) + self.matchers[i].flush()
                    yield ChoiceDelta(i, tail, [], "stop" if ev.reason in ("stop", "cancelled") else ev.reason)
        finally:
            self.cancel()   # a client that went away frees its sequences at the next step
