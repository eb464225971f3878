#!/usr/bin/env python3
"""What the HTTP front end costs: `engine serve`'s app in front of a stand-in engine core that emits one token per
running request every --step-ms (as a GPU step would), loaded by scripts/load_test.py.

    python scripts/bench_http.py MODEL.gguf --clients 1,8,32,64 --step-ms 10 --slots 64 [--seconds 8]

The stand-in runs no model: the figure is the front end's (tokenization, detokenization, stop strings, SSE,
uvicorn) and the load generator's ceiling on this machine. A core that steps every S ms with B requests running
emits B / S tokens per ms; each row prints that ceiling beside what the clients received.
MODEL only supplies the tokenizer.
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass

import httpx
import numpy as np
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from server.core import CoreConfig  # noqa: E402
from server.messages import (Abort, AddRequest, CoreStats, Event, Outputs, Ready, Shutdown, encoder,  # noqa: E402
                             to_core_decoder)


@dataclass
class StandInConfig(CoreConfig):
    step_ms: float = 10.0


def stand_in_core(cfg: StandInConfig, in_addr: str, out_addr: str) -> None:
    """The engine core's protocol without a model: every step, one random token for each running request."""
    from engine.gguf import GGUFFile
    from engine.tokenizer import Tokenizer

    n_vocab = Tokenizer(GGUFFile(cfg.model)).n_vocab
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(in_addr)
    push.connect(out_addr)
    slots = cfg.n_parallel or 64
    push.send(encoder.encode(Ready(cfg.n_ctx or 4096, n_vocab, slots, "stand-in", 512)))
    rng = np.random.default_rng(0)
    running: dict[int, int] = {}            # rid -> tokens left
    waiting: deque[AddRequest] = deque()
    generated = steps = 0
    while True:
        if pull.poll(0 if running or waiting else 1000):
            while True:
                try:
                    msg = to_core_decoder.decode(pull.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if isinstance(msg, AddRequest):
                    waiting.append(msg)
                elif isinstance(msg, Abort):
                    for rid in msg.rids:
                        running.pop(rid, None)
                elif isinstance(msg, Shutdown):
                    return
        while waiting and len(running) < slots:
            req = waiting.popleft()
            running[req.rid] = req.max_tokens
        events = []
        if running:
            time.sleep(cfg.step_ms / 1000)
            steps += 1
            for rid, tok in zip(list(running), rng.integers(300, min(n_vocab, 20000), len(running))):
                events.append(Event(rid, int(tok)))
                running[rid] -= 1
                if running[rid] == 0:
                    del running[rid]
                    events.append(Event(rid, -1, finish="length"))
            generated += len(events)
        push.send(encoder.encode(Outputs(events, CoreStats(running=len(running), waiting=len(waiting),
                                                           generated_tokens_total=generated, steps=steps))))


def serve(model: str, port: int, slots: int, step_ms: float) -> None:
    import uvicorn

    from server.app import ServerConfig, create_app
    cfg = ServerConfig(StandInConfig(model, n_parallel=slots, n_ctx=4096, step_ms=step_ms), core_main=stand_in_core)
    uvicorn.run(create_app(cfg), host="127.0.0.1", port=port, log_level="warning", access_log=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--clients", default="1,8,32,64")
    ap.add_argument("--seconds", type=float, default=8)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=8391)
    ap.add_argument("--procs", type=int, default=None, help="load-generator processes (load_test.py's default)")
    args = ap.parse_args()
    server = multiprocessing.get_context("spawn").Process(target=serve, args=(args.model, args.port, args.slots,
                                                                                args.step_ms))
    server.start()
    url = f"http://127.0.0.1:{args.port}"
    deadline = time.time() + 120
    while time.time() < deadline and server.is_alive():
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    else:
        sys.exit("bench_http: the server did not come up")
    print(f"# stand-in core: {args.slots} slots, a step every {args.step_ms} ms; server pid {server.pid}", flush=True)
    here = os.path.dirname(os.path.abspath(__file__))
    for c in (int(x) for x in args.clients.split(",")):
        cmd = [sys.executable, os.path.join(here, "load_test.py"), "--url", url, "--clients", str(c), "--seconds",
               str(args.seconds), "--max-tokens", str(args.max_tokens)] + \
            (["--procs", str(args.procs)] if args.procs else [])
        out = subprocess.run(cmd, capture_output=True, text=True).stdout.strip()
        ceiling = min(c, args.slots) / args.step_ms * 1000
        print(f"{out} | core ceiling {ceiling:.0f} tokens/s", flush=True)
    server.terminate()
    server.join(5)


if __name__ == "__main__":
    main()
