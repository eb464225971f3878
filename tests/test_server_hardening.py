"""What no request may do to the server: stop it, freeze it, or get anything but an OpenAI error body."""
import collections
import json
import os
import random
import signal
import string
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_server import PROMPT, start_server

pytestmark = pytest.mark.slow


def core_pid(server_pid: int) -> int:
    """The engine-core process: the server's child started by multiprocessing's spawn."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == server_pid and b"spawn_main" in cmd:
            return int(d.name)
    raise RuntimeError("no engine-core process found")


def is_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == status
    return err


@pytest.fixture(scope="module")
def server(model_path):
    model_path("smol")
    proc, base = start_server("--parallel", "2", "--max-queue", "1", "--max-body-mb", "1")
    yield base, proc
    proc.terminate()
    proc.wait(timeout=10)


@pytest.mark.parametrize("method,path,body,status,param", [
    ("GET", "/v1/nothing", None, 404, None),
    ("DELETE", "/v1/completions", None, 405, None),
    ("POST", "/v1/completions", {"prompt": [-1], "max_tokens": 1}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": [49152], "max_tokens": 1}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": [2 ** 70], "max_tokens": 1}, 400, "prompt"),
    ("POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "echo": True, "logprobs": 1,
                                 "temperature": float("nan")}, 400, None),
    ("POST", "/detokenize", {"tokens": [49152]}, 400, "tokens"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": []}]}]},
     400, "messages"),
    ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
])
def test_client_errors_are_openai_bodies(server, method, path, body, status, param):
    base, _ = server
    content = None if body is None else json.dumps(body, allow_nan=True)
    r = httpx.request(method, base + path, content=content, headers={"content-type": "application/json"})
    err = is_openai_error(r, status)
    if param is not None:
        assert err["param"] == param


def test_lone_surrogate_and_huge_body(server):
    base, _ = server
    for raw in ('{"prompt": "\\ud800", "max_tokens": 1}',
                '{"messages": [{"role": "user", "content": "a\\udfffb"}]}'):
        path = "/v1/completions" if "prompt" in raw else "/v1/chat/completions"
        is_openai_error(httpx.post(base + path, content=raw, headers={"content-type": "application/json"}), 400)
    big = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    t0 = time.monotonic()
    is_openai_error(httpx.post(base + "/v1/completions", content=big, headers={"content-type": "application/json"}),
                    413)
    assert time.monotonic() - t0 < 5


def test_long_word_tokenizes_fast_and_health_stays_up(server):
    base, _ = server
    random.seed(1)
    text = "".join(random.choice(string.ascii_letters) for _ in range(64 * 1024))
    health = []

    def poll():
        for _ in range(10):
            t = time.monotonic()
            httpx.get(base + "/health", timeout=30)
            health.append(time.monotonic() - t)
            time.sleep(0.05)
    th = threading.Thread(target=poll)
    th.start()
    t0 = time.monotonic()
    r = httpx.post(base + "/tokenize", json={"content": text}, timeout=120)
    took = time.monotonic() - t0
    th.join()
    assert r.status_code == 200 and len(r.json()["tokens"]) > 1000
    assert took < 5, took                       # 21.5 s before the tokenizer was linear
    assert max(health) < 1.0, health


def test_queue_full_is_429_with_retry_after(server):
    base, _ = server
    results = []

    def one(i):
        r = httpx.post(base + "/v1/completions", json={"prompt": f"Story {i}", "max_tokens": 60, "ignore_eos": True},
                       timeout=120)
        results.append(r)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]   # 2 slots + 1 queued: 3 refused
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 3 and set(codes) <= {200, 429}, codes
    for r in results:
        if r.status_code == 429:
            is_openai_error(r, 429)
            assert r.headers["retry-after"] == "1"


def test_dead_engine_core_gives_503_not_a_hang(model_path, tmp_path):
    model_path("smol")
    key = tmp_path / "key"
    key.write_text("sekret\n")
    proc, base = start_server("--parallel", "1", "--api-key-file", str(key))
    auth = {"authorization": "Bearer sekret"}
    try:
        r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=auth, timeout=60)
        assert r.status_code == 200
        os.kill(core_pid(proc.pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        while httpx.get(base + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.1)
        h = httpx.get(base + "/health")
        assert h.status_code == 503 and h.json() == {"status": "error"}          # no details without the key
        assert "exited" in httpx.get(base + "/health", headers=auth).json()["error"]
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, headers=auth, timeout=30)
        is_openai_error(r, 503)
        assert time.monotonic() - t0 < 5
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    err = Path(proc.log_path).read_text()           # the terminal says why, once
    assert err.count("ERROR the engine core exited") == 1, err[-2000:]


def test_stuck_engine_core_gives_503(model_path):
    model_path("smol")
    proc, base = start_server("--parallel", "1", "--core-timeout", "2")
    core = core_pid(proc.pid)
    try:
        os.kill(core, signal.SIGSTOP)
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=30)
        is_openai_error(r, 503)
        assert time.monotonic() - t0 < 8
        assert httpx.get(base + "/health").status_code == 503
    finally:
        os.kill(core, signal.SIGCONT)
        proc.terminate()
        proc.wait(timeout=10)


def test_request_log_line(model_path):
    model_path("smol")
    proc, base = start_server("--parallel", "1")
    try:
        httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        httpx.get(base + "/v1/models")
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    err = Path(proc.log_path).read_text()
    assert "POST /v1/completions 200 prompt=5 completion=3 ttft=" in err and "duration=" in err, err[-2000:]
    assert "GET /v1/models 200" in err
    assert "model loaded on cpu: context 256, parallel 1, KV cache 16 blocks x 16 positions" in err, err[-2000:]


def test_fuzzed_requests(server):
    """300 malformed requests: never a 5xx or a dropped connection, every 4xx an OpenAI body, and a greedy request
    answers the same before and after (scripts/fuzz.py requests runs 10,000)."""
    import random
    from fuzz_requests import bad_answer, mutated_request
    base, _ = server
    seed = random.randrange(2 ** 31)
    rng = random.Random(seed)
    greedy = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=base, timeout=60) as http:
        before = http.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
        for i in range(300):
            method, path, raw = mutated_request(rng)
            r = http.request(method, path, content=raw, headers={"content-type": "application/json"})
            assert not bad_answer(r), (seed, i, method, path, raw[:200], r.status_code, r.text[:300])
        assert http.post("/v1/completions", json=greedy).json()["choices"][0]["text"] == before


REQUEST_FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                  "min_p", "seed", "n", "stop", "logprobs", "top_logprobs", "echo", "stream", "stream_options",
                  "presence_penalty", "frequency_penalty", "repeat_penalty", "repeat_last_n", "ignore_eos", "user",
                  "logit_bias", "response_format", "tools", "tool_choice", "content", "tokens", "model", "suffix"]
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "n")


def json_values():
    """Any JSON value: scalars of every kind (big integers, NaN and inf floats, unicode text), nested a few deep."""
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                        st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=8)


@st.composite
def request_bodies(draw):
    """(path, body): a valid request of some route with fields added, replaced by any JSON value, or dropped."""
    from fuzz_requests import VALID
    path, body = draw(st.sampled_from(VALID))
    body = json.loads(json.dumps(body))
    for key in draw(st.lists(st.sampled_from(REQUEST_FIELDS) | st.text(max_size=12), max_size=4)):
        body[key] = draw(json_values())
    for key in draw(st.lists(st.sampled_from(sorted(body)), max_size=2, unique=True)) if body else []:
        body.pop(key, None)
    for key in LENGTH_FIELDS:            # bounded, so that a valid draw generates a few tokens, not thousands
        if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > 4:
            body[key] = body[key] % 5
    return path, body


def test_hypothesis_requests(server):
    """Property: any body hypothesis draws gets a 200 or a 4xx with an OpenAI error body, never a 5xx, a dropped
    connection or a hang; and a greedy request answers the same afterwards."""
    from fuzz_requests import bad_answer
    base, _ = server
    greedy = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    statuses = collections.Counter()
    with httpx.Client(base_url=base, timeout=60) as http:
        before = http.post("/v1/completions", json=greedy).json()["choices"][0]["text"]

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(case=request_bodies())
        def check(case):
            path, body = case
            raw = json.dumps(body, allow_nan=True).encode()
            r = http.post(path, content=raw, headers={"content-type": "application/json"})
            statuses[r.status_code] += 1
            assert not bad_answer(r), (path, raw[:300], r.status_code, r.text[:300])

        check()
        assert statuses[200] >= 10 and statuses[400] >= 10, statuses      # both sides of the line were reached
        assert http.post("/v1/completions", json=greedy).json()["choices"][0]["text"] == before


def test_connections_that_never_finish_their_headers_are_closed(model_path):
    """Item 5: a connection holding half a request (or trickling it a byte at a time) is closed after --header-timeout;
    a keep-alive client pausing between requests longer than that is not."""
    import socket
    model_path("smol")
    proc, base = start_server("--parallel", "1", "--header-timeout", "1", "--keep-alive", "5")
    port = int(base.rsplit(":", 1)[1])
    try:
        half = socket.create_connection(("127.0.0.1", port))
        half.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        trickle = socket.create_connection(("127.0.0.1", port))
        t0 = time.time()

        def closed(s) -> bool:
            try:
                s.settimeout(3)
                return s.recv(100) == b""                  # closed by the server, no response
            except ConnectionResetError:
                return True
        try:
            for b in b"GET /health HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n":
                trickle.sendall(bytes([b]))
                time.sleep(0.1)
        except OSError:                                    # the server closed it mid-trickle
            pass
        assert closed(trickle) and time.time() - t0 < 4
        assert closed(half)
        with httpx.Client() as c:
            for _ in range(2):
                assert c.get(base + "/health").status_code == 200
                time.sleep(1.5)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
