"""The engine from Python, on strings: prompts batched through the scheduler, chats through the model's template.

    from engine import LLM, SamplingParams
    llm = LLM("smollm2-135m")                                  # a path or a short name; device "auto"
    outs = llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(temperature=0), max_tokens=16)
    print(outs[0].text, outs[0].finish_reason)
    print(llm.chat([{"role": "user", "content": "Hi!"}]).text)
    llm.chat([{"role": "user", "content": "A person?"}], json_schema={"type": "object", ...})   # structured output
    for piece in llm.stream("Once upon a time"): print(piece, end="")
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .grammar import compile_grammar
from .runtime import Runtime
from .sampling import SamplingParams
from .scheduler import FinishEvent, Request, Scheduler, TokenEvent
from .stop import StopMatcher


@dataclass
class Completion:
    text: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"         # "stop" (end of generation or a stop string) | "length" | "error"
    prompt_tokens: int = 0
    error: str | None = None


class _Choice:
    """One request's text as it comes: detokenized, stop strings matched."""

    def __init__(self, llm: "LLM", prompt: list[int], stops: list[str]):
        self.out = Completion("", prompt_tokens=len(prompt))
        self.decoder, self.matcher = llm.tokenizer.stream_decoder(), StopMatcher(stops)
        self.pieces: list[str] = []           # text not yet taken by a stream
        self.done = False
        self.sid = -1

    def on_event(self, ev) -> None:
        if isinstance(ev, TokenEvent):
            if self.matcher.stopped:
                return
            self.out.tokens.append(ev.token)
            self._text(self.matcher.feed(self.decoder.add(ev.token)))
            return
        if isinstance(ev, FinishEvent):
            if not self.matcher.stopped:
                self._text(self.matcher.feed(self.decoder.flush()) + self.matcher.flush())
            self.out.finish_reason = "stop" if ev.reason == "cancelled" else ev.reason
            self.out.error = ev.error
            self.done = True

    def _text(self, text: str) -> None:
        if text:
            self.out.text += text
            self.pieces.append(text)


class LLM:
    """A model loaded once; generate / chat / stream run its requests through one Scheduler (n_parallel at once).
    kv_memory (bytes) and kv_type ("f16", "q8_0") size and store a paged KV cache (the cpu backend; Runtime)."""

    def __init__(self, model: str | None = None, device: str = "auto", n_ctx: int | None = None,
                 n_parallel: int = 4, n_ubatch: int = 512, kv_memory: float | None = None,
                 kv_type: str | None = None):
        self.rt = Runtime.load(model, device=device, n_ctx=n_ctx, n_seq=n_parallel, n_ubatch=n_ubatch,
                               kv_memory=kv_memory, kv_type=kv_type)
        self.tokenizer = self.rt.tokenizer
        self.scheduler = Scheduler(self.rt)

    def _submit(self, prompt: list[int], params: SamplingParams | None, max_tokens: int,
                stop: list[str] | None, grammar: str | None = None) -> _Choice:
        choice = _Choice(self, prompt, stop or [])
        choice.sid = self.scheduler.submit(Request(prompt, params or SamplingParams(), max_tokens, grammar=grammar),
                                           choice.on_event)
        return choice

    @staticmethod
    def _grammar(json_schema, grammar) -> str | None:
        """The compiled grammar of a JSON schema or a GBNF grammar (GrammarError if it does not compile)."""
        if json_schema is None and grammar is None:
            return None
        return compile_grammar(json_schema=json_schema) if grammar is None else compile_grammar(gbnf=grammar)

    def _stop_when_matched(self, choices: list[_Choice]) -> None:
        for c in choices:
            if c.matcher.stopped and not c.done:
                self.scheduler.cancel(c.sid)

    def _run(self, choices: list[_Choice]) -> list[Completion]:
        while not all(c.done for c in choices):
            self.scheduler.step()
            self._stop_when_matched(choices)
        return [c.out for c in choices]

    def generate(self, prompts: str | list[str], params: SamplingParams | None = None, max_tokens: int = 128,
                 stop: list[str] | None = None, json_schema: dict | None = None,
                 grammar: str | None = None) -> list[Completion]:
        """Complete each prompt (batched together) -> one Completion per prompt, in order; with json_schema (or a
        GBNF grammar) every completion is constrained to it."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        g = self._grammar(json_schema, grammar)
        return self._run([self._submit(self.tokenizer.encode(p), params, max_tokens, stop, g) for p in prompts])

    def chat(self, messages: list[dict], params: SamplingParams | None = None, max_tokens: int = 512,
             stop: list[str] | None = None, json_schema: dict | None = None, grammar: str | None = None) -> Completion:
        """The assistant's reply to a conversation ([{"role": ..., "content": ...}, ...]), via the model's chat
        template; constrained to json_schema or a GBNF grammar when given."""
        g = self._grammar(json_schema, grammar)
        return self._run([self._submit(self.tokenizer.chat_prompt_ids(messages), params, max_tokens, stop, g)])[0]

    def stream(self, prompt: str, params: SamplingParams | None = None, max_tokens: int = 128,
               stop: list[str] | None = None):
        """Yield the completion's text piece by piece as it is generated."""
        choice = self._submit(self.tokenizer.encode(prompt), params, max_tokens, stop)
        try:
            while not choice.done:
                self.scheduler.step()
                self._stop_when_matched([choice])
                while choice.pieces:
                    yield choice.pieces.pop(0)
            while choice.pieces:
                yield choice.pieces.pop(0)
        finally:
            if not choice.done:                # the caller stopped iterating: free its sequence
                self.scheduler.cancel(choice.sid)
                self.scheduler.step()


__all__ = ["LLM", "Completion", "SamplingParams"]
