#!/usr/bin/env python3
"""Long fuzz runs (tests/test_fuzz.py and tests/test_server_hardening.py run short ones on CI).

    python scripts/fuzz.py gguf --cases 10000 [--workers 2]      mutations of both real models' headers
    python scripts/fuzz.py requests --url http://127.0.0.1:8080 --cases 10000
    python scripts/fuzz.py soak --url http://127.0.0.1:8080 --pid SERVER_PID --clients 64 --minutes 10

gguf: each case is written under /dev/shm and checked in a worker process with a 10 s limit and an address-space cap
(tests/fuzz_gguf.py check_file: open, configure, tokenize, load with shape checks); prints the failures, hangs and
the workers' peak memory. requests: malformed and hostile requests against a running server; every answer must be a
4xx with an OpenAI error body (or a 200 for a request that happens to be valid), none a 5xx or a hang, and a greedy
request gives the same text before and after.
"""
import argparse
import json
import multiprocessing as mp
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]      # the project (not necessarily installed) and its test helpers

CASE_SECONDS = 10
SLOW_REQUEST_S = 300             # a request past the fuzz client's 30 s is asked again alone, with this long
ADDRESS_SPACE = 6 << 30          # a guard, far above the acceptance's 2 GB peak resident memory


def _gguf_worker(jobs, results):
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    from fuzz_gguf import check_file
    for path in iter(jobs.get, None):
        t0 = time.monotonic()
        problem = check_file(path)
        results.put((path, problem, time.monotonic() - t0,
                     resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024))


class _Worker:
    """A checking process with its own job queue, restarted when a case runs past CASE_SECONDS."""

    def __init__(self, ctx, results):
        self.ctx, self.results = ctx, results
        self.start()

    def start(self):
        self.jobs = self.ctx.Queue()
        self.proc = self.ctx.Process(target=_gguf_worker, args=(self.jobs, self.results), daemon=True)
        self.proc.start()
        self.path, self.deadline = None, 0.0

    def give(self, path: str) -> None:
        self.path, self.deadline = path, time.monotonic() + CASE_SECONDS + 30   # + a fresh worker's imports
        self.jobs.put(path)


def fuzz_gguf(args) -> int:
    import numpy as np
    from engine.hub import fetch
    from fuzz_gguf import Header, mutate, write_case
    sources = [str(fetch(n)) for n in ("smollm2-135m", "gemma3-270m")]
    headers = {s: Header.read(s) for s in sources}
    rng = np.random.default_rng(args.seed)
    tmp = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    workers = [_Worker(ctx, results) for _ in range(args.workers)]
    failures, hangs, peak, done, given, slowest = [], 0, 0, 0, 0, 0.0
    t_start = time.monotonic()
    while done < args.cases:
        for i, w in enumerate(workers):
            if w.path is None and given < args.cases:
                src = sources[given % 2]
                path = os.path.join(tmp, f"case{i}-{given}.gguf")
                write_case(path, mutate(headers[src], rng), src, headers[src])
                w.give(path)
                given += 1
        try:
            path, problem, secs, rss = results.get(timeout=0.5)
        except Exception:
            path = None
        for w in workers:
            if path is not None and w.path == path:
                w.path = None
                os.unlink(path)
                done += 1
                peak, slowest = max(peak, rss), max(slowest, secs)
                hangs += secs > CASE_SECONDS
                if problem:
                    failures.append((path, problem))
                if done % 500 == 0:
                    print(f"{done} cases, {len(failures)} failures, {hangs} hangs, peak {peak / 2**30:.2f} GB, "
                          f"slowest {slowest:.1f} s, {time.monotonic() - t_start:.0f} s", flush=True)
            elif w.path is not None and time.monotonic() > w.deadline:      # a hang: kill, count, restart
                w.proc.kill()
                w.proc.join()
                hangs += 1
                done += 1
                failures.append((w.path, "no answer within the time limit"))
                w.start()
    for w in workers:
        w.jobs.put(None)
    for path, problem in failures[:20]:
        print(f"{os.path.basename(path)}: {problem}")
    print(f"gguf fuzz: {done} cases (seed {args.seed}), {len(failures)} failures, {hangs} hangs past "
          f"{CASE_SECONDS} s, peak resident memory {peak / 2**30:.2f} GB, slowest {slowest:.1f} s, "
          f"{time.monotonic() - t_start:.0f} s")
    return 1 if failures or hangs else 0


# -- requests ------------------------------------------------------------------------------------------------------
def fuzz_requests(args) -> int:
    import httpx
    from fuzz_requests import bad_answer, mutated_request
    rng = random.Random(args.seed)
    greedy = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    with httpx.Client(base_url=args.url, timeout=30) as http:
        before = http.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
        bad, slow, hangs, statuses = [], [], 0, {}
        for i in range(args.cases):
            method, path, raw = mutated_request(rng)
            try:
                r = http.request(method, path, content=raw, headers={"content-type": "application/json"})
            except httpx.TimeoutException:            # slow (a long valid generation) or hung: asked again alone
                t0 = time.monotonic()
                try:
                    r = http.request(method, path, content=raw, headers={"content-type": "application/json"},
                                     timeout=SLOW_REQUEST_S)
                    slow.append((i, f"{r.status_code} in {time.monotonic() - t0:.1f} s alone", f"{raw[:100]!r}"))
                except httpx.TimeoutException:
                    hangs += 1
                    bad.append((i, f"no answer in 30 s, nor in {SLOW_REQUEST_S} s alone",
                                f"{method} {path} {raw[:150]!r}"))
                    continue
            except httpx.TransportError as e:              # the server dropped the connection: a failure too
                bad.append((i, type(e).__name__, f"{method} {path} {raw[:150]!r}"))
                continue
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            if bad_answer(r):
                bad.append((i, r.status_code, r.text[:200]))
        after = http.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
    for b in bad[:20]:
        print("case", *b)
    for s in slow[:20]:
        print("slow case", *s)
    print(f"request fuzz: {args.cases} requests (seed {args.seed}), statuses {dict(sorted(statuses.items()))}, "
          f"{len(bad)} bad answers, {hangs} hangs, {len(slow)} slow (past 30 s under the fuzz's load, answered "
          f"alone), greedy text {'unchanged' if before == after else 'CHANGED'}")
    return 1 if bad or before != after else 0


# -- soak ----------------------------------------------------------------------------------------------------------
def _rss_of_tree(pid: int) -> int:
    """Resident bytes of a process and its children (the server and its engine core)."""
    total, pids = 0, [pid]
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    pids.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    for p in pids:
        try:
            total += int((Path(f"/proc/{p}/statm").read_text().split()[1])) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


async def _soak_client(url, deadline, rng, stats):
    import httpx
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        while time.time() < deadline:
            body = {"prompt": f"Story {rng.randrange(10 ** 6)}:", "max_tokens": rng.randint(1, 48), "stream": True,
                    "temperature": rng.choice([0, 0.7, 1.0]), "ignore_eos": rng.random() < 0.5}
            stop_after = rng.choice([None, None, 1, 3, 10])                   # None: read to the end
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code == 429:
                        stats["429"] += 1
                        await r.aread()
                        continue
                    if r.status_code != 200:
                        stats["errors"].append(f"status {r.status_code}")
                        continue
                    n, done = 0, False
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                            stats["errors"].append(line[:200])
                        n += line.startswith("data: ")
                        if stop_after is not None and n >= stop_after:
                            stats["disconnects"] += 1
                            break                                          # the client goes away mid-stream
                    stats["completed"] += done
            except Exception as e:   # noqa: BLE001
                stats["errors"].append(f"{type(e).__name__}: {e}")


def soak(args) -> int:
    """args.clients streaming clients for args.minutes against a server (pid args.pid for its memory): random
    lengths, temperatures and disconnects; then every slot must be free and memory within 5 % of its warm level."""
    import asyncio

    import httpx
    stats = {"completed": 0, "disconnects": 0, "429": 0, "errors": []}
    rng = random.Random(args.seed)

    async def run(seconds):
        deadline = time.time() + seconds
        await asyncio.gather(*(_soak_client(args.url, deadline, random.Random(rng.random()), stats)
                               for _ in range(args.clients)))
    asyncio.run(run(30))                                                    # warm: every graph and buffer made
    warm = _rss_of_tree(args.pid)
    asyncio.run(run(args.minutes * 60))
    time.sleep(2)
    metrics = dict(line.split() for line in httpx.get(args.url + "/metrics").text.splitlines()
                   if line and not line.startswith("#"))
    end = _rss_of_tree(args.pid)
    growth = end / warm - 1
    print(f"soak: {args.clients} clients, {args.minutes} min: {stats['completed']} completed, {stats['disconnects']} "
          f"disconnects, {stats['429']} refused with 429, {len(stats['errors'])} errors {stats['errors'][:3]}; "
          f"running {metrics['engine:num_requests_running']}, waiting {metrics['engine:num_requests_waiting']}, "
          f"free slots {metrics['engine:kv_slots_free']}; memory {warm / 2**20:.0f} -> {end / 2**20:.0f} MB "
          f"({growth:+.1%})")
    return 1 if stats["errors"] or float(metrics["engine:num_requests_running"]) != 0 or growth > 0.05 else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["gguf", "requests", "soak"])
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--pid", type=int, default=0, help="soak: the server's pid, for its memory")
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    args = ap.parse_args()
    sys.exit({"gguf": fuzz_gguf, "requests": fuzz_requests, "soak": soak}[args.what](args))


if __name__ == "__main__":
    main()
