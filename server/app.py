"""`engine serve`: an OpenAI-compatible HTTP API (FastAPI) in front of the engine-core process.

This process parses requests, tokenizes and renders chat templates (in a thread pool, off the event loop),
detokenizes, matches stop strings and streams server-sent events; the engine-core process (server/core.py) runs
the scheduler and the model. Every error is answered in the OpenAI format; a dead or stuck engine core turns into
503s and `/health` says so.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import __version__
from engine.gguf import GGUFFile
from engine.grammar import GrammarError, compile_grammar
from engine.sampling import seed_bits
from engine.tokenizer import TemplateLimits, Tokenizer, TokenizerError

from .client import CoreConfig, EngineClient, EngineUnavailable, GenerationError, MultiChoice
from .core import run_core
from .messages import AddRequest, SlotState
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE, ServerMetrics
from .protocol import (APIError, ChatRequest, CompletionRequest, DetokenizeRequest, InfillRequest,
                       LlamaCompletionRequest, TokenizeRequest)
from .tools import (CallStream, ToolError, call_grammar, parse_calls, prompt_messages, template_knows_tools,
                    tool_spec)

MAX_CACHED_GRAMMARS = 64       # compiled structured-output grammars kept (the oldest dropped first)

CHAT_PAGE = Path(__file__).parent / "static" / "chat.html"
log = logging.getLogger("engine.server")


@dataclass
class ServerConfig:
    core: CoreConfig
    api_key: str | None = None
    metrics_key: str | None = None            # /metrics asks for this key when set (it is open otherwise)
    model_id: str | None = None
    max_body_bytes: int = 16 << 20            # a request body larger than this is refused (413) before parsing
    max_queue: int = 256                      # sequences waiting beyond the KV slots; more get 429
    prompt_chars_per_token: int = 64          # prompts longer than n_ctx times this are refused before tokenizing
    template: TemplateLimits = field(default_factory=TemplateLimits)
    stall_s: float = 300.0                    # an engine core silent this long with requests waiting is stuck
    tokenizer_threads: int = 4
    cors: str | None = None                   # an origin allowed cross-origin requests ("*": any); None: none
    core_main: Callable = run_core            # the engine-core process's main (scripts/bench.py http: a stand-in)


class BodyLimit:
    """ASGI middleware: a request body past max_bytes gets 413 (by its content-length, or as it arrives)."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            return await _send_error(send, APIError(413, f"the request body is larger than {self.max_bytes} bytes"))
        seen = 0

        async def limited():
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise APIError(413, f"the request body is larger than {self.max_bytes} bytes")
            return msg
        return await self.app(scope, limited, send)


class KeyAndLog:
    """ASGI middleware: 401 where refused(request) says the key is wrong; one log line for each request that does
    not log itself (a generation logs its own, with its TTFT). Plain ASGI, so a stream's chunks go straight to the
    server (starlette's BaseHTTPMiddleware passes each through its own task and memory stream)."""

    def __init__(self, app, refused: Callable[[Request], bool]):
        self.app, self.refused = app, refused

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.monotonic(), 500

        async def send_status(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)
        request = Request(scope, receive)
        if self.refused(request):
            await _send_error(send_status, APIError(401, "invalid or missing API key"))
        else:
            await self.app(scope, receive, send_status)
        if not scope.get("state", {}).get("logs_itself"):
            log.info("%s %s %d %.0fms", scope["method"], scope["path"], status, (time.monotonic() - t0) * 1000)


async def _send_error(send, err: APIError) -> None:
    body = json.dumps(err.body()).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def create_app(cfg: ServerConfig) -> FastAPI:
    model_id = cfg.model_id or Path(cfg.core.model).name
    state = {"engine": None, "tokenizer": None, "created": int(time.time())}
    grammars: dict[str, str] = {}          # compiled grammars by their source (response_format, json_schema, ...)
    pool = ThreadPoolExecutor(max_workers=cfg.tokenizer_threads, thread_name_prefix="engine-tokenizer")

    @asynccontextmanager
    async def lifespan(app):
        engine = EngineClient(cfg.core, stall_s=cfg.stall_s, core_main=cfg.core_main)
        state["engine"] = engine
        state["tokenizer"] = await asyncio.get_running_loop().run_in_executor(
            pool, lambda: Tokenizer(GGUFFile(cfg.core.model)))
        await engine.start()
        loop = asyncio.get_running_loop()
        app.state.end_streams = lambda: loop.call_soon_threadsafe(engine.end_streams, "abort")
        yield
        await engine.close()
        pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="engine", lifespan=lifespan)
    server_metrics = ServerMetrics(lambda: state["engine"])
    app.add_middleware(BodyLimit, max_bytes=cfg.max_body_bytes)

    async def blocking(fn, *args):
        """Run tokenizer or template work in the pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    # -- errors and auth ---------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        message = {404: f"no route {request.url.path}", 405: f"method {request.method} not allowed on "
                   f"{request.url.path}"}.get(exc.status_code, str(exc.detail))
        return error_response(APIError(exc.status_code, message))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") in ("json_invalid", "json_type"):
            detail = first.get("ctx", {}).get("error", "") or first.get("msg", "")
            return error_response(APIError(400, f"malformed JSON body: {detail}"))
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        return error_response(APIError(400, f"invalid request: {msg}" + (f" (field '{param}')" if param else ""),
                                       loc[0] if loc else None))

    @app.exception_handler(Exception)
    async def internal_error(request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}"))

    def key_ok(request: Request, key: str | None = None) -> bool:
        key = key or cfg.api_key
        given = request.headers.get("authorization", "")
        return bool(key) and hmac.compare_digest(given.encode(), f"Bearer {key}".encode())

    def refused_key(request: Request) -> bool:
        """/health is open; /metrics asks for --metrics-key when one is set, nothing otherwise; the rest for the API
        key when one is set."""
        path = request.url.path
        if path in ("/health", "/"):                  # the chat page asks for the key itself
            return False
        if path == "/metrics":
            return bool(cfg.metrics_key) and not key_ok(request, cfg.metrics_key)
        return bool(cfg.api_key) and not key_ok(request)

    app.add_middleware(KeyAndLog, refused=refused_key)

    def engine() -> EngineClient:
        e = state["engine"]
        try:
            e.check()
        except EngineUnavailable as err:
            raise APIError(503, str(err)) from None
        return e

    def check_model(name: str | None) -> None:
        if name and name != model_id:
            raise APIError(404, f"model '{name}' not found (this server serves '{model_id}')", "model")

    def check_fields(body) -> None:
        refused = body.refused_field()
        if refused:
            raise APIError(400, f"'{refused[0]}': {refused[1]}", refused[0])

    # -- plain endpoints ---------------------------------------------------------------------------------------
    @app.get("/")
    async def chat_page():
        """A chat page (static HTML/JS) streaming through /v1/chat/completions."""
        return HTMLResponse(CHAT_PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health(request: Request):
        e = state["engine"]
        if e.error:
            body = {"status": "error"}
            if key_ok(request) or not cfg.api_key:
                body["error"] = e.error
            return JSONResponse(body, status_code=503)
        if e.ready is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": state["created"],
                                            "owned_by": "engine"}]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name)
        return {"id": model_id, "object": "model", "created": state["created"], "owned_by": "engine"}

    @app.get("/props")
    async def props():
        """llama-server's /props: the server's settings."""
        e = state["engine"]
        ready = e.ready
        return {"model_path": cfg.core.model, "model_alias": model_id, "total_slots": ready.n_seq if ready else None,
                "n_ctx": ready.n_ctx if ready else None, "chat_template": state["tokenizer"].chat_template or "",
                "build_info": f"engine {__version__}", "default_generation_settings": {
                    "n_ctx": ready.n_ctx if ready else None, "params": {
                        k: CompletionRequest.model_fields[k].default for k in (
                            "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                            "presence_penalty", "frequency_penalty")}}}

    @app.get("/slots")
    async def slots():
        """llama-server's /slots: each KV slot at the engine core's last step (the request in it, its prompt and
        cached tokens, the tokens decoded, the tokens its cache holds)."""
        e = engine()
        n_ctx, n_seq = (e.ready.n_ctx, e.ready.n_seq) if e.ready else (None, 0)
        busy = {s.id: s for s in e.stats.slots}
        states = [busy.get(i) or SlotState(i) for i in range(n_seq)]
        return [{"id": s.id, "id_task": s.request, "n_ctx": n_ctx, "is_processing": s.request >= 0,
                 "n_prompt_tokens": s.prompt_tokens, "n_prompt_tokens_cache": s.cached_tokens,
                 "n_decoded": s.generated, "n_past": s.n_past} for s in states]

    @app.get("/metrics")
    async def metrics():
        return Response(server_metrics.render(), media_type=METRICS_CONTENT_TYPE)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        tok = state["tokenizer"]
        ids = await blocking(lambda: tok.encode(body.content, add_special=body.add_special,
                                                parse_special=body.parse_special))
        if body.with_pieces:
            return {"tokens": [{"id": i, "piece": tok.piece(i)} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        tok = state["tokenizer"]
        check_ids(body.tokens, "tokens")
        return {"content": await blocking(tok.decode, body.tokens)}

    # -- generation --------------------------------------------------------------------------------------------
    def limit_prompt(text: str) -> None:
        e = state["engine"]
        n_ctx = e.ready.n_ctx if e.ready else (cfg.core.n_ctx or 4096)
        limit = n_ctx * cfg.prompt_chars_per_token
        if len(text) > limit:
            raise APIError(400, f"the prompt has {len(text)} characters, more than {limit} (the context of {n_ctx} "
                                "tokens can hold no more)", "prompt", "context_length_exceeded")

    def check_ids(ids: list[int], param: str) -> None:
        n_vocab = state["tokenizer"].n_vocab
        if not ids or (min(ids) >= 0 and max(ids) < n_vocab):       # C loops; the scan below names the bad one
            return
        bad = next((t for t in ids if not 0 <= t < n_vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (0..{n_vocab - 1})", param)

    async def grammar_of(body) -> str | None:
        """The compiled grammar of a request's structured output (response_format, json_schema, grammar), compiled
        off the event loop and cached per source; 400 naming the field when it is malformed or does not compile."""
        try:
            source = body.grammar_source()
        except ValueError as err:
            raise APIError(400, str(err), next(k for k in ("response_format", "json_schema", "grammar")
                                               if k in (body.model_extra or {}))) from None
        if source is None:
            return None
        return await compiled(*source)

    async def compiled(name: str, args: dict) -> str:
        key = json.dumps(args, sort_keys=True)
        if key not in grammars:
            try:
                grammars[key] = await blocking(lambda: compile_grammar(**args))
            except GrammarError as err:
                raise APIError(400, f"'{name}': {err}", name) from None
            if len(grammars) > MAX_CACHED_GRAMMARS:
                grammars.pop(next(iter(grammars)))
        return grammars[key]

    def start(e: EngineClient, body, prompts: list[list[int]], max_tokens: int, top_logprobs,
              grammar: str | None = None, prompt_logprobs: int | None = None) -> MultiChoice:
        """The request's n choices of each prompt submitted, choice k of prompt k // n (prompt_logprobs: each
        prompt's first choice also scores its prompt)."""
        ready = e.check()
        for i, prompt in enumerate(prompts):
            name = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not prompt:
                raise APIError(400, f"{'the prompt' if len(prompts) == 1 else name} is empty", "prompt")
            check_ids(prompt, name)
            if len(prompt) + max_tokens > ready.n_ctx:
                raise APIError(400, f"the {name} ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                    f"context of {ready.n_ctx} tokens", "max_tokens", "context_length_exceeded")
        bias = body.token_bias()
        if bias:
            check_ids(list(bias), "logit_bias")
        n = len(prompts) * body.n
        if n > ready.n_seq + cfg.max_queue:
            raise APIError(400, f"this request asks for {n} sequences ({len(prompts)} prompts x n = {body.n}), more "
                                f"than the server runs and queues at once ({ready.n_seq + cfg.max_queue})", "n")
        if e.in_flight + n > ready.n_seq + cfg.max_queue:
            raise APIError(429, f"the server is full ({e.in_flight} sequences running or queued); retry later",
                           headers={"Retry-After": "1"})
        reqs = [AddRequest(0, prompts[k // body.n], max_tokens, body.ignore_eos, top_logprobs, body.temperature,
                           body.top_k, body.top_p, body.min_p, body.repeat_penalty, body.repeat_last_n,
                           body.presence_penalty, body.frequency_penalty,
                           seed_bits(None if body.seed is None else body.seed + k), grammar, bias,
                           prompt_logprobs if k % body.n == 0 else None)
                for k in range(n)]
        try:
            return MultiChoice(e, state["tokenizer"], reqs, body.stops(), body.n)
        except EngineUnavailable as err:
            raise APIError(503, str(err)) from None

    def as_api_error(err: Exception) -> APIError:
        return APIError(503 if isinstance(err, EngineUnavailable) else err.status, str(err))

    def completion_logprobs(tokens, offset0: int, prompt: list[int] | None = None, scored: list | None = None):
        """The completions API's logprobs of the generated tokens (events) from text offset offset0; with prompt
        (echo), the prompt's tokens first, from offset 0: scored[j - 1] = (log-prob, top) of prompt token j, the
        first token none (MultiChoice.prompt_logprobs)."""
        tok = state["tokenizer"]
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}

        def add(entries, offset):
            for tid, lp, top in entries:
                piece = tok.piece(tid)
                out["tokens"].append(piece)
                out["token_logprobs"].append(lp)
                out["top_logprobs"].append({tok.piece(i): v for i, v in top} if top else None)
                out["text_offset"].append(offset)
                offset += len(piece)
        if prompt is not None:
            lps = [None] + list(scored or [None] * (len(prompt) - 1))
            add([(t, *(lp or (None, None))) for t, lp in zip(prompt, lps)], 0)
        add([(ev.token, ev.logprob, ev.top) for ev in tokens], offset0)
        return out

    def chat_logprobs(tokens):
        tok = state["tokenizer"]

        def entry(tid, lp):
            b = tok.token_bytes(tid, special=True)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}
        return {"content": [{**entry(ev.token, ev.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in (ev.top or [])]} for ev in tokens]}

    def usage(mc: MultiChoice) -> dict:
        c = sum(mc.completion_tokens)
        return {"prompt_tokens": mc.prompt_tokens, "completion_tokens": c, "total_tokens": mc.prompt_tokens + c,
                "prompt_tokens_details": {"cached_tokens": mc.cached_tokens}}

    def log_generation(request: Request, status: int, mc: MultiChoice | None, t0: float) -> None:
        now = time.monotonic()
        if mc is not None:
            server_metrics.observe(mc.first_token_at - t0 if mc.first_token_at else None, mc.token_gaps, now - t0,
                                   mc.queue_seconds)
        ttft = f"{(mc.first_token_at - t0) * 1000:.0f}ms" if mc and mc.first_token_at else "-"
        log.info("%s %s %d prompt=%d completion=%d ttft=%s duration=%.0fms", request.method, request.url.path,
                 status, mc.prompt_tokens if mc else 0, sum(mc.completion_tokens) if mc else 0, ttft,
                 (now - t0) * 1000)

    async def collect(mc: MultiChoice, request: Request, n: int):
        texts, toks, reasons = [""] * n, [[] for _ in range(n)], [None] * n
        try:
            async for d in mc.deltas():
                texts[d.index] += d.text
                toks[d.index] += d.tokens
                if d.finish_reason:
                    reasons[d.index] = d.finish_reason
                if await request.is_disconnected():
                    mc.cancel()
                    return None
        except (GenerationError, EngineUnavailable) as e:
            raise as_api_error(e) from None
        return texts, toks, reasons

    def sse(obj) -> bytes:
        return b"data: " + msgspec.json.encode(obj) + b"\n\n"

    def stream(mc: MultiChoice, body, cid: str, created: int, object_type: str, head: list[dict], choice_of,
               request: Request, t0: float, deltas=None):
        """Server-sent events: the head choices, one chunk per delta (of mc, or of `deltas` drawn from it), the
        usage chunk if asked, then [DONE]."""
        def frame(choices, **extra) -> str:
            return sse({"id": cid, "object": object_type, "created": created, "model": model_id,
                        "choices": choices, **extra})

        async def frames():
            for c in head:
                yield frame([c])
            async for d in deltas if deltas is not None else mc.deltas():
                yield frame([choice_of(d)])
            if (body.stream_options or {}).get("include_usage"):
                yield frame([], usage=usage(mc))
            yield b"data: [DONE]\n\n"
        return StreamingResponse(sse_events(frames(), mc, request, t0), media_type="text/event-stream")

    async def sse_events(frames, mc: MultiChoice, request: Request, t0: float):
        """A stream's body: its frames, then the error event should generation fail; logged at the end."""
        status = 200
        try:
            async for f in frames:
                yield f
        except (GenerationError, EngineUnavailable) as e:
            err = as_api_error(e)
            status = err.status
            yield sse(err.body())
        finally:
            log_generation(request, status, mc, t0)

    async def finished(mc: MultiChoice, request: Request, n: int, t0: float):
        """A whole (not streamed) answer, logged: (texts, tokens, finish reasons), or None when the client left
        (logged as 499)."""
        try:
            result = await collect(mc, request, n)
        except APIError as err:
            log_generation(request, err.status, mc, t0)
            raise
        log_generation(request, 200 if result is not None else 499, mc, t0)
        return result

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        t0 = time.monotonic()
        e = engine()
        check_model(body.model)
        check_fields(body)
        tok = state["tokenizer"]
        # a text, token ids, or a list of either: one prompt each, its n choices k * n.. (OpenAI's batched prompts)
        many = isinstance(body.prompt, list) and bool(body.prompt) and not isinstance(body.prompt[0], int)
        given = list(body.prompt) if many else [body.prompt]
        for p in given:
            if isinstance(p, str):
                limit_prompt(p)
        prompts = [await blocking(tok.encode, p) if isinstance(p, str) else list(p) for p in given]
        for i, p in enumerate(prompts):
            check_ids(p, f"prompt[{i}]" if many else "prompt")
        texts = [p if isinstance(p, str) else await blocking(tok.decode, ids) if body.echo else ""
                 for p, ids in zip(given, prompts)]
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        scored = body.echo and body.logprobs is not None     # the prompt's log-probs too (OpenAI's legacy API)
        if scored and body.stream:
            raise APIError(400, "echo with logprobs (the prompt's log-probs) is answered whole: stream must be false",
                           "stream")
        mc = start(e, body, prompts, max_tokens, body.logprobs, await grammar_of(body),
                   body.logprobs if scored else None)
        request.state.logs_itself = True
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        n = len(prompts) * body.n
        echo = [texts[k // body.n] if body.echo else "" for k in range(n)]

        def chunk(index, text, tokens, reason, with_lp):
            c = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
            if with_lp and body.logprobs is not None:
                c["logprobs"] = completion_logprobs(tokens, 0)
            return c

        if body.stream:
            head = [chunk(k, echo[k], [], None, False) for k in range(n)] if body.echo else []
            return stream(mc, body, cid, created, "text_completion", head,
                          lambda d: chunk(d.index, d.text, d.tokens, d.finish_reason, True), request, t0)
        result = await finished(mc, request, n, t0)
        if result is None:
            return JSONResponse({}, status_code=499)
        outs, toks, reasons = result
        choices = [{"index": k, "text": echo[k] + outs[k], "finish_reason": reasons[k],
                    "logprobs": None if body.logprobs is None else
                    completion_logprobs(toks[k], len(echo[k]), *((prompts[k // body.n],
                                                                  mc.prompt_logprobs[k // body.n]) if scored else ()))}
                   for k in range(n)]
        return {"id": cid, "object": "text_completion", "created": created, "model": model_id,
                "choices": choices, "usage": usage(mc)}

    @app.post("/completion")
    async def llama_completion(body: LlamaCompletionRequest, request: Request):
        """llama-server's native endpoint: {"content", "stop", "stop_type", "tokens_predicted", ...}, streamed as
        bare JSON events; n_probs gives each token's top candidates (completion_probabilities)."""
        t0 = time.monotonic()
        e = engine()
        check_model(body.model)
        check_fields(body)
        tok = state["tokenizer"]
        if isinstance(body.prompt, str):
            limit_prompt(body.prompt)
            prompt = await blocking(tok.encode, body.prompt)
        else:
            prompt = list(body.prompt)
            check_ids(prompt, "prompt")
        return await llama_generate(body, prompt, request, e, t0)

    @app.post("/infill")
    async def infill(body: InfillRequest, request: Request):
        """llama-server's fill-in-the-middle: [extra files] <PRE> prefix <SUF> suffix <MID> prompt, generated on as
        /completion; a 400 naming the missing tokens where the model has none."""
        t0 = time.monotonic()
        e = engine()
        check_model(body.model)
        check_fields(body)
        tok = state["tokenizer"]
        missing = [f"fim_{p}" for p in ("pre", "suf", "mid") if tok.fim[p] is None]
        if missing:
            raise APIError(400, f"this model has no fill-in-the-middle tokens ({', '.join(missing)} not in its "
                                "vocabulary): /infill needs a code model that has them")
        texts = [body.input_prefix, body.input_suffix] + [c.filename + c.text for c in body.input_extra]
        if isinstance(body.prompt, str):
            texts.append(body.prompt)
        limit_prompt("".join(texts))

        def build() -> list[int]:
            ids = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
            for chunk in body.input_extra:                 # other files first: <file_sep>name\ntext, or the text
                if tok.fim["sep"] is not None:
                    ids += [tok.fim["sep"]] + tok.encode(f"{chunk.filename}\n{chunk.text}", add_special=False)
                else:
                    ids += tok.encode(chunk.text, add_special=False)
            ids += [tok.fim["pre"]] + tok.encode(body.input_prefix, add_special=False)
            ids += [tok.fim["suf"]] + tok.encode(body.input_suffix, add_special=False) + [tok.fim["mid"]]
            return ids + (tok.encode(body.prompt, add_special=False) if isinstance(body.prompt, str)
                          else list(body.prompt))
        prompt = await blocking(build)
        if not isinstance(body.prompt, str):
            check_ids(prompt, "prompt")
        return await llama_generate(body, prompt, request, e, t0)

    async def llama_generate(body: LlamaCompletionRequest, prompt: list[int], request: Request, e, t0: float):
        """The rest of /completion and /infill: generate on from the prompt ids, answered llama-server's way."""
        body.n = 1
        tok = state["tokenizer"]
        max_tokens = body.n_predict if body.n_predict >= 0 else max(1, e.check().n_ctx - len(prompt))
        mc = start(e, body, [prompt], max_tokens, body.n_probs or None, await grammar_of(body))
        request.state.logs_itself = True

        def probs(tokens) -> list[dict]:
            def entry(tid, lp):
                b = tok.token_bytes(tid, special=True)
                return {"id": tid, "token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}
            return [{**entry(ev.token, ev.logprob), "top_logprobs": [entry(i, lp) for i, lp in (ev.top or [])]}
                    for ev in tokens]

        def piece(text: str, tokens) -> dict:
            out = {"content": text, "tokens": [ev.token for ev in tokens], "stop": False}
            if body.n_probs:
                out["completion_probabilities"] = probs(tokens)
            return out

        def final(text: str, reason: str | None, tokens) -> dict:
            matcher = mc.matchers[0]
            elapsed = time.monotonic() - t0
            first = (mc.first_token_at - t0) if mc.first_token_at else elapsed
            done = mc.completion_tokens[0]
            out = {"content": text, "tokens": [ev.token for ev in tokens], "stop": True, "model": model_id,
                   "stop_type": "limit" if reason == "length" else "word" if matcher.stopped else "eos",
                   "stopping_word": matcher.word or "", "tokens_predicted": done,
                   "tokens_evaluated": mc.prompt_tokens, "tokens_cached": mc.cached_tokens, "truncated": False,
                   "generation_settings": {k: getattr(body, k) for k in (
                       "temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                       "presence_penalty", "frequency_penalty", "seed", "n_predict", "ignore_eos")},
                   "timings": {"prompt_n": mc.prompt_tokens - mc.cached_tokens, "prompt_ms": 1000 * first,
                               "predicted_n": done, "predicted_ms": 1000 * (elapsed - first),
                               "predicted_per_second": (done - 1) / (elapsed - first) if done > 1 and
                               elapsed > first else 0.0}}
            if body.n_probs:
                out["completion_probabilities"] = probs(tokens)
            return out

        if body.stream:
            async def frames():
                async for d in mc.deltas():
                    if not d.finish_reason or d.text or d.tokens:
                        yield sse(piece(d.text, d.tokens))
                    if d.finish_reason:
                        yield sse(final("", d.finish_reason, []))
            return StreamingResponse(sse_events(frames(), mc, request, t0), media_type="text/event-stream")
        result = await finished(mc, request, 1, t0)
        if result is None:
            return JSONResponse({}, status_code=499)
        texts, toks, reasons = result
        return final(texts[0], reasons[0], toks[0])

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        t0 = time.monotonic()
        e = engine()
        check_model(body.model)
        check_fields(body)
        tok = state["tokenizer"]
        extra = body.model_extra or {}
        try:
            messages = [m.as_dict() for m in body.messages]
            spec = tool_spec(extra.get("tools"), extra.get("tool_choice"))
        except ToolError as err:
            raise APIError(400, str(err), err.param) from None
        except ValueError as err:
            raise APIError(400, str(err), "messages") from None
        limit_prompt("".join(m["content"] for m in messages))
        native = spec is not None and template_knows_tools(tok.template_source)
        to_render = prompt_messages(messages, spec, native)
        tools = [{"type": "function", "function": f} for f in spec.functions] if native else None

        def render() -> list[int]:
            text = tok.apply_chat_template(to_render, limits=cfg.template, tools=tools,
                                           variables=body.chat_template_kwargs)
            limit_prompt(text)
            return tok.chat_prompt_ids_from_text(text)
        try:
            prompt = await blocking(render)
        except TokenizerError as err:
            raise APIError(400, str(err), "messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = limit if limit is not None else max(1, e.check().n_ctx - len(prompt))
        top = (body.top_logprobs or 0) if body.logprobs else None
        grammar = await grammar_of(body)
        if spec is not None and spec.mode != "auto":
            if grammar is not None:
                raise APIError(400, "tool_choice required or a named function cannot go with a response format",
                               "tool_choice")
            grammar = await compiled("tools", {"lark": call_grammar(spec)})
        mc = start(e, body, [prompt], max_tokens, top, grammar)
        request.state.logs_itself = True
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def message_of(text: str, reason: str | None) -> tuple[dict, str | None]:
            """The reply as an assistant message (tool calls parsed out when the request has tools)."""
            if spec is not None:
                content, calls = parse_calls(text, spec)
                if calls:
                    return {"role": "assistant", "content": content, "tool_calls": calls}, \
                        "tool_calls" if reason == "stop" else reason
            return {"role": "assistant", "content": text}, reason

        if body.stream:
            head = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for i in range(body.n)]

            def choice_of(d):
                return {"index": d.index, "delta": {"content": d.text} if d.text or not d.finish_reason else {},
                        "finish_reason": d.finish_reason,
                        "logprobs": chat_logprobs(d.tokens) if body.logprobs else None}
            if spec is None:
                return stream(mc, body, cid, created, "chat.completion.chunk", head, choice_of, request, t0)

            async def tool_deltas():             # with tools: content as it comes, calls (tools.CallStream)
                parsers, n_calls = [CallStream(spec) for _ in range(body.n)], [0] * body.n
                try:
                    async for d in mc.deltas():
                        p = parsers[d.index]
                        for kind, value in p.feed(d.text) + (p.finish() if d.finish_reason else []):
                            if kind == "content":
                                delta = {"content": value}
                            elif kind == "call_args":         # a fragment of the call that call_head opened
                                delta = {"tool_calls": [{"index": n_calls[d.index] - 1,
                                                         "function": {"arguments": value}}]}
                            else:                             # a whole call, or the head of a streamed one
                                delta = {"tool_calls": [{"index": n_calls[d.index], **value}]}
                                n_calls[d.index] += 1
                            yield {"index": d.index, "delta": delta, "finish_reason": None, "logprobs": None}
                        if d.finish_reason:
                            reason = "tool_calls" if n_calls[d.index] and d.finish_reason == "stop" else d.finish_reason
                            yield {"index": d.index, "delta": {}, "finish_reason": reason, "logprobs": None}
                finally:
                    mc.cancel()                  # a client gone mid-stream frees its sequences
            return stream(mc, body, cid, created, "chat.completion.chunk", head, lambda c: c, request, t0,
                          tool_deltas())
        result = await finished(mc, request, body.n, t0)
        if result is None:
            return JSONResponse({}, status_code=499)
        texts, toks, reasons = result
        choices = []
        for i in range(body.n):
            msg, reason = message_of(texts[i], reasons[i])
            choices.append({"index": i, "message": msg, "finish_reason": reason,
                            "logprobs": chat_logprobs(toks[i]) if body.logprobs else None})
        return {"id": cid, "object": "chat.completion", "created": created, "model": model_id,
                "choices": choices, "usage": usage(mc)}

    if cfg.cors:              # outermost: a browser's preflight is answered before the API key is asked for
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=[cfg.cors], allow_methods=["GET", "POST", "OPTIONS"],
                           allow_headers=["authorization", "content-type"])
    return app
