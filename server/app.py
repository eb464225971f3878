"""`engine serve`: an OpenAI-compatible HTTP API (FastAPI) over the continuous-batching scheduler."""
from __future__ import annotations

import json
import threading
import time
import uuid
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from engine.runtime import ContextLengthError, Runtime
from engine.sampling import SamplingParams
from engine.scheduler import Request as EngineRequest
from engine.scheduler import Scheduler
from engine.tokenizer import TokenizerError

from .engine_loop import GenerationError, MultiChoice
from .protocol import APIError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest


class ServerState:
    def __init__(self):
        self.runtime: Runtime | None = None
        self.sched: Scheduler | None = None
        self.model_id = ""
        self.load_error: str | None = None
        self.created = int(time.time())


def create_app(model: str, device: str = "auto", n_parallel: int = 4, n_ctx: int | None = None,
               api_key: str | None = None, model_id: str | None = None, n_ubatch: int = 512,
               kv_f32: bool = False) -> FastAPI:
    state = ServerState()
    state.model_id = model_id or Path(model).name

    def load():
        try:
            rt = Runtime.load(model, device=device, n_ctx=n_ctx, n_seq=n_parallel, n_ubatch=n_ubatch, kv_f32=kv_f32)
            sched = Scheduler(rt)
            sched.run_in_thread()
            state.runtime, state.sched = rt, sched
        except Exception as e:   # reported by /health and every request
            state.load_error = f"{type(e).__name__}: {e}"

    @asynccontextmanager
    async def lifespan(app):
        threading.Thread(target=load, name="engine-load", daemon=True).start()
        yield
        if state.sched:
            state.sched.shutdown()

    app = FastAPI(title="engine", lifespan=lifespan)
    app.state.engine = state

    # -- errors and auth ---------------------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        if first.get("type") == "json_invalid":
            return JSONResponse(APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', '')}").body(),
                                status_code=400)
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        param = ".".join(loc) or None
        msg = first.get("msg", "invalid request")
        message = f"invalid request: {msg}" + (f" (field '{param}')" if param else "")
        return JSONResponse(APIError(400, message, param).body(), status_code=400)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return JSONResponse(APIError(401, "invalid or missing API key").body(), status_code=401)
        return await call_next(request)

    def ready() -> tuple[Runtime, Scheduler]:
        if state.load_error:
            raise APIError(503, f"model failed to load: {state.load_error}")
        if state.sched is None:
            raise APIError(503, "model is loading")
        return state.runtime, state.sched

    def check_model(name: str | None) -> None:
        if name and name != state.model_id:
            raise APIError(404, f"model '{name}' not found (this server serves '{state.model_id}')", "model")

    # -- plain endpoints ---------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if state.load_error:
            return JSONResponse({"status": "error", "error": state.load_error}, status_code=503)
        if state.sched is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": state.created,
                                            "owned_by": "engine"}]}

    @app.get("/metrics")
    async def metrics():
        s = state.sched
        st = s.stats if s else None
        lines = []
        for name, kind, value in [
            ("engine_requests_total", "counter", st.requests_total if st else 0),
            ("engine_requests_finished_total", "counter", st.requests_finished if st else 0),
            ("engine_requests_running", "gauge", len(s.running) if s else 0),
            ("engine_requests_waiting", "gauge", s.queue_length if s else 0),
            ("engine_prompt_tokens_total", "counter", st.prompt_tokens_total if st else 0),
            ("engine_prompt_tokens_shared_total", "counter", st.prompt_tokens_shared if st else 0),
            ("engine_generated_tokens_total", "counter", st.generated_tokens_total if st else 0),
            ("engine_generated_tokens_per_second", "gauge", round(st.tokens_per_second, 3) if st else 0),
            ("engine_kv_slots_free", "gauge", len(s.free_slots) if s else 0),
        ]:
            lines += [f"# TYPE {name} {kind}", f"{name} {value}"]
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        rt, _ = ready()
        ids = rt.tokenizer.encode(body.content, add_special=body.add_special, parse_special=body.parse_special)
        if body.with_pieces:
            return {"tokens": [{"id": i, "piece": rt.tokenizer.piece(i)} for i in ids]}
        return {"tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        rt, _ = ready()
        try:
            return {"content": rt.tokenizer.decode(body.tokens)}
        except TokenizerError as e:
            raise APIError(400, str(e), "tokens") from None

    # -- generation --------------------------------------------------------------------------------------------
    def engine_requests(rt: Runtime, body, prompt: list[int], max_tokens: int, top_logprobs) -> list[EngineRequest]:
        reqs = []
        for i in range(body.n):
            seed = None if body.seed is None else body.seed + i
            params = SamplingParams(temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                                    min_p=body.min_p, repeat_penalty=body.repeat_penalty,
                                    presence_penalty=body.presence_penalty,
                                    frequency_penalty=body.frequency_penalty, seed=seed)
            reqs.append(EngineRequest(prompt, params, max_tokens, body.ignore_eos, top_logprobs))
        return reqs

    def start(rt, sched, body, prompt, max_tokens, top_logprobs) -> MultiChoice:
        if not prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        if any(not 0 <= t < rt.tokenizer.n_vocab for t in prompt):
            raise APIError(400, "prompt token id outside the vocabulary", "prompt")
        try:
            return MultiChoice(sched, rt.tokenizer, engine_requests(rt, body, prompt, max_tokens, top_logprobs),
                               body.stops())
        except ContextLengthError as e:
            raise APIError(400, str(e), "max_tokens", "context_length_exceeded") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def completion_logprobs(rt, tokens, offset0: int):
        tok = rt.tokenizer
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = offset0
        for ev in tokens:
            piece = tok.piece(ev.token)
            out["tokens"].append(piece)
            out["token_logprobs"].append(ev.logprob)
            out["top_logprobs"].append({tok.piece(i): lp for i, lp in ev.top} if ev.top else None)
            out["text_offset"].append(offset)
            offset += len(piece)
        return out

    def chat_logprobs(rt, tokens):
        tok = rt.tokenizer

        def entry(tid, lp):
            b = tok.token_bytes(tid, special=True)
            return {"token": b.decode("utf-8", errors="replace"), "logprob": lp, "bytes": list(b)}
        return {"content": [{**entry(ev.token, ev.logprob),
                             "top_logprobs": [entry(i, lp) for i, lp in (ev.top or [])]} for ev in tokens]}

    def usage(mc: MultiChoice) -> dict:
        c = sum(mc.completion_tokens)
        return {"prompt_tokens": mc.prompt_tokens, "completion_tokens": c, "total_tokens": mc.prompt_tokens + c}

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
        except GenerationError as e:
            raise APIError(500, str(e)) from None
        return texts, toks, reasons

    def sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def stream(mc: MultiChoice, body, cid: str, created: int, object_type: str, head: list[dict], choice_of):
        """Server-sent events: the head choices, one chunk per delta, the usage chunk if asked, then [DONE]."""
        def frame(choices, **extra) -> str:
            return sse({"id": cid, "object": object_type, "created": created, "model": state.model_id,
                        "choices": choices, **extra})

        async def events():
            try:
                for c in head:
                    yield frame([c])
                async for d in mc.deltas():
                    yield frame([choice_of(d)])
                if (body.stream_options or {}).get("include_usage"):
                    yield frame([], usage=usage(mc))
                yield "data: [DONE]\n\n"
            except GenerationError as e:
                yield sse(APIError(500, str(e)).body())
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        rt, sched = ready()
        check_model(body.model)
        if isinstance(body.prompt, list) and body.prompt and isinstance(body.prompt[0], str):
            if len(body.prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt")
            body.prompt = body.prompt[0]
        prompt_text = body.prompt if isinstance(body.prompt, str) else rt.tokenizer.decode(body.prompt)
        prompt = rt.tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        mc = start(rt, sched, body, prompt, max_tokens, body.logprobs)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        echo = prompt_text if body.echo else ""

        def chunk(index, text, tokens, reason, with_lp):
            c = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
            if with_lp and body.logprobs is not None:
                c["logprobs"] = completion_logprobs(rt, tokens, 0)
            return c

        if body.stream:
            head = [chunk(i, echo, [], None, False) for i in range(body.n)] if echo else []
            return stream(mc, body, cid, created, "text_completion", head,
                          lambda d: chunk(d.index, d.text, d.tokens, d.finish_reason, True))

        result = await collect(mc, request, body.n)
        if result is None:
            return JSONResponse({}, status_code=499)
        texts, toks, reasons = result
        choices = [{"index": i, "text": echo + texts[i], "finish_reason": reasons[i],
                    "logprobs": completion_logprobs(rt, toks[i], len(echo)) if body.logprobs is not None else None}
                   for i in range(body.n)]
        return {"id": cid, "object": "text_completion", "created": created, "model": state.model_id,
                "choices": choices, "usage": usage(mc)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        rt, sched = ready()
        check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = rt.tokenizer.chat_prompt_ids(messages)
        except TokenizerError as e:
            raise APIError(400, str(e), "messages") from None
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = limit if limit is not None else max(1, rt.n_ctx - len(prompt))
        top = (body.top_logprobs or 0) if body.logprobs else None
        mc = start(rt, sched, body, prompt, max_tokens, top)
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        if body.stream:
            head = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None} for i in range(body.n)]

            def choice_of(d):
                return {"index": d.index, "delta": {"content": d.text} if d.text or not d.finish_reason else {},
                        "finish_reason": d.finish_reason,
                        "logprobs": chat_logprobs(rt, d.tokens) if body.logprobs else None}
            return stream(mc, body, cid, created, "chat.completion.chunk", head, choice_of)

        result = await collect(mc, request, body.n)
        if result is None:
            return JSONResponse({}, status_code=499)
        texts, toks, reasons = result
        choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "finish_reason": reasons[i],
                    "logprobs": chat_logprobs(rt, toks[i]) if body.logprobs else None} for i in range(body.n)]
        return {"id": cid, "object": "chat.completion", "created": created, "model": state.model_id,
                "choices": choices, "usage": usage(mc)}

    return app
