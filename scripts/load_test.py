#!/usr/bin/env python3
"""Load test: N concurrent streaming clients for T seconds against a running `engine serve` (or llama-server).

    python scripts/load_test.py --url http://127.0.0.1:8080 --clients 8 --seconds 30 --max-tokens 64 [--procs 4] \
        [--json-schema]

--shared-prefix N starts every prompt with the same N-token system text (prefix caching: TTFT with it on and off;
the mean of usage.prompt_tokens_details.cached_tokens is printed). With --burst, instead of the timed load: one
request, then --clients requests at once, --rounds times (each round new questions after the shared text): the TTFT
of the requests after the first, the prefix computed once.

--json-schema asks every request for structured output (response_format json_schema, RECORD_SCHEMA below; EOS is
then honoured, so requests end where the JSON does): the serving cost of the grammar masks.

Prints requests/s, generated tokens/s (from the moment every client process is up to the end of the last request), p50/p99 time to first token and per-token latency, and the error count.
The clients are spread over --procs processes (default: one per 16 clients) so that parsing the streams of many
clients does not make the load generator the bottleneck: one Python process tops out near 900 streamed tokens/s.
"""
import argparse
import asyncio
import json
import multiprocessing
import sys
import time

import httpx
import numpy as np

SPAWN_S = 2.0     # time given to the client processes to start before the clock starts
PREFIX_WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on", "be", "at",
                "by", "this", "had", "not", "are", "but", "from", "or", "have", "an", "they", "which", "one", "you",
                "were")   # --shared-prefix: common words, one token each (with their space) in BPE vocabularies
RECORD_SCHEMA = {   # --json-schema: nested objects, an array of enums, bounded numbers, required fields
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue", "story", "poem"]}, "maxItems": 4},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "summary": {"type": "string"},
    },
    "required": ["name", "age", "score", "tags", "address", "summary"],
}


async def client_loop(url, deadline, args, stats, cid):
    async with httpx.AsyncClient(timeout=300) as http:
        i = 0
        while time.time() < deadline:
            prompt = [5 + (cid * 7 + i + j) % 50 for j in range(8)] if args.token_prompts else \
                f"Client {cid} request {i}: write a story about"
            if args.shared_prefix:
                prompt = shared_prefix(args) + prompt
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0.8, "seed": cid * 1000 + i,
                    "stream": True, "ignore_eos": not args.json_schema, "stream_options": {"include_usage": True}}
            if args.json_schema:
                body["response_format"] = {"type": "json_schema",
                                           "json_schema": {"name": "record", "schema": RECORD_SCHEMA}}
            headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            try:
                streamed = await stream_completion(http, url, body, headers)
            except httpx.HTTPError:
                streamed = None
            if streamed is None:
                stats["errors"] += 1
                continue
            t0, times, used, cached = streamed
            stats["cached"] += cached
            if times:
                stats["ttft"].append(times[0] - t0)
                stats["itl"].extend(np.diff(times).tolist())
                stats["tokens"] += used if used is not None else len(times)
            stats["requests"] += 1
            i += 1


async def stream_completion(http, url, body, headers):
    """One streamed completion -> (its start, the perf_counter time of each text chunk, usage's completion tokens
    (None without usage), its cached prompt tokens); None when the server answered with an error status."""
    t0, times, used, cached = time.perf_counter(), [], None, 0
    async with http.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return None
        async for line in r.aiter_lines():
            obj = sse_event(line)
            if obj is None:
                continue
            if has_text(obj):
                times.append(time.perf_counter())
            if obj.get("usage"):
                used, cached = obj["usage"].get("completion_tokens"), cached_tokens(obj["usage"])
    return t0, times, used, cached


def sse_event(line) -> dict | None:
    """A server-sent event's JSON object (line: str or bytes), None for other lines and the final [DONE]."""
    line = line.decode() if isinstance(line, bytes) else line
    return json.loads(line[6:]) if line.startswith("data: ") and line != "data: [DONE]" else None


def has_text(obj: dict) -> bool:
    return bool(obj.get("choices") and obj["choices"][0].get("text"))


def cached_tokens(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


class RawStream:
    """One streamed completion over a connection of its own, opened before the clock starts, through asyncio's
    sockets and the request bytes encoded beforehand: --burst times the server, not the client. (httpx, one process
    for the whole burst, read a burst of 32 at TTFT p50 203 ms against 64 ms this way, before bench.py's stand-in
    core on a 2-core machine.)"""

    def __init__(self, url: str, body: dict, headers: dict):
        self.host, self.port = url.split("://", 1)[-1].rstrip("/").rsplit(":", 1)
        data = json.dumps(body).encode()
        head = ["POST /v1/completions HTTP/1.1", f"host: {self.host}:{self.port}", "content-type: application/json",
                f"content-length: {len(data)}"] + [f"{k}: {v}" for k, v in headers.items()]
        self.request = ("\r\n".join(head) + "\r\n\r\n").encode() + data

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, int(self.port))

    async def run(self):
        """-> (its start, the time of its first text chunk or None, its cached prompt tokens); None on an error
        status."""
        t0, first, cached = time.perf_counter(), None, 0
        self.writer.write(self.request)
        await self.writer.drain()
        status = await self.reader.readline()
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if b" 200 " not in status or "chunked" not in headers.get("transfer-encoding", ""):
            self.writer.close()
            return None
        pending = b""
        while size := int((await self.reader.readline()).split(b";")[0], 16):     # chunked body: size, data
            pending += (await self.reader.readexactly(size + 2))[:-2]
            *events, pending = pending.split(b"\n\n")
            for obj in filter(None, map(sse_event, events)):
                if first is None and has_text(obj):
                    first = time.perf_counter()
                if obj.get("usage"):
                    cached = cached_tokens(obj["usage"])
        self.writer.close()
        return t0, first, cached


async def burst(args) -> None:
    """--burst: per round, one request (it computes the shared text), then --clients requests at once, each on a
    connection opened beforehand (RawStream)."""
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    ttfts, cached = [], []
    for rnd in range(args.rounds):
        def body(i):
            question = [5 + (rnd * 37 + i * 7 + j) % 50 for j in range(20)] if args.token_prompts else \
                f"Round {rnd} question {i}: in one short sentence, what is the meaning of the text above?"
            return {"prompt": shared_prefix(args) + question, "max_tokens": args.max_tokens, "temperature": 0.0,
                    "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        streams = [RawStream(args.url, body(i), headers) for i in range(-1, args.clients)]
        for s in streams:
            await s.open()
        results = [await streams[0].run()]
        results += await asyncio.gather(*(s.run() for s in streams[1:]))
        for streamed in results:
            if streamed is None or streamed[1] is None:
                sys.exit("load_test.py --burst: a request failed or streamed no text")
        for t0, first, c in results[1:]:
            ttfts.append(first - t0)
            cached.append(c)
    ms = np.array(ttfts) * 1000
    print(f"burst of {args.clients} after one, {args.rounds} rounds: TTFT p50 {np.percentile(ms, 50):.0f} ms "
          f"p90 {np.percentile(ms, 90):.0f} ms max {ms.max():.0f} ms, cached prompt tokens per request "
          f"{np.mean(cached):.0f}")


def shared_prefix(args):
    """The --shared-prefix system text (token ids with --token-prompts) every prompt starts with."""
    if args.token_prompts:
        return [60 + j % 100 for j in range(args.shared_prefix)]
    return "System: " + " ".join(PREFIX_WORDS[j % len(PREFIX_WORDS)] for j in range(args.shared_prefix)) + "\n"


async def run_clients(args, client_ids, start, deadline) -> dict:
    stats = {"requests": 0, "tokens": 0, "errors": 0, "cached": 0, "ttft": [], "itl": []}
    await asyncio.sleep(max(0.0, start - time.time()))
    await asyncio.gather(*(client_loop(args.url, deadline, args, stats, c) for c in client_ids))
    stats["end"] = time.time()
    return stats


def worker(args, client_ids, start, deadline, results):
    results.put(asyncio.run(run_clients(args, client_ids, start, deadline)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--procs", type=int, default=None, help="client processes (default: ceil(clients / 16))")
    ap.add_argument("--token-prompts", action="store_true",
                    help="send prompts as token ids (models whose tokenizer has no words, e.g. the tests' tiny models)")
    ap.add_argument("--json-schema", action="store_true", help="structured output (RECORD_SCHEMA) on every request")
    ap.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                    help="every prompt starts with the same N-token system text")
    ap.add_argument("--burst", action="store_true",
                    help="one request, then --clients at once, --rounds times: their TTFT (with --shared-prefix)")
    ap.add_argument("--rounds", type=int, default=5, help="--burst rounds")
    args = ap.parse_args()
    if args.burst:
        asyncio.run(burst(args))
        return
    procs = max(1, min(args.clients, args.procs or -(-args.clients // 16)))
    start = time.time() + SPAWN_S                      # every process starts its clients then
    deadline = start + args.seconds
    results = multiprocessing.get_context("spawn").Queue()
    workers = [multiprocessing.get_context("spawn").Process(
        target=worker, args=(args, list(range(p, args.clients, procs)), start, deadline, results))
        for p in range(procs)]
    for w in workers:
        w.start()
    parts = [results.get() for _ in workers]
    for w in workers:
        w.join()
    elapsed = max(p.pop("end") for p in parts) - start     # to the last request's end
    stats = {k: sum((p[k] for p in parts), [] if isinstance(parts[0][k], list) else 0) for k in parts[0]}
    p = lambda xs, q: float(np.percentile(xs, q)) * 1000 if xs else float("nan")  # noqa: E731
    print(f"clients {args.clients} ({procs} processes), {elapsed:.1f} s: {stats['requests'] / elapsed:.2f} "
          f"requests/s, {stats['tokens'] / elapsed:.1f} generated tokens/s, TTFT p50 {p(stats['ttft'], 50):.0f} ms "
          f"p99 {p(stats['ttft'], 99):.0f} ms, per-token p50 {p(stats['itl'], 50):.1f} ms "
          f"p99 {p(stats['itl'], 99):.1f} ms, errors {stats['errors']}"
          + (f", cached prompt tokens per request {stats['cached'] / max(1, stats['requests']):.0f}"
             if args.shared_prefix else ""))


if __name__ == "__main__":
    main()
