"""Malformed and hostile requests for the server's fuzz tests (tests/test_server_hardening.py, scripts/fuzz.py)."""
import json
import random

VALID = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("/tokenize", {"content": "Hello"}),
    ("/detokenize", {"tokens": [1, 2, 3]}),
]
ODD_VALUES = [None, True, -1, 0, 2 ** 70, -2 ** 70, 1e308, -1e-310, "", "x" * 5000, "\ud800", [], {}, [[[]]],
              {"a": {"b": [1]}}, [-1], [2 ** 40], "\x00\x1b[2J", 3.5, "NaN"]


def mutated_request(rng: random.Random) -> tuple[str, str, bytes]:
    """(method, path, body): a valid request of some route with one to three fields broken, sometimes broken JSON,
    another method or an unknown path."""
    path, body = rng.choice(VALID)
    body = json.loads(json.dumps(body))
    for _ in range(rng.randint(1, 3)):
        kind = rng.random()
        if kind < 0.5 and body:                     # a field gets an odd value
            key = rng.choice(list(body))
            body[key] = rng.choice(ODD_VALUES)
        elif kind < 0.7:                             # a known field of another route, or an unknown one
            key = rng.choice(["temperature", "top_p", "top_k", "min_p", "seed", "n", "stop", "logprobs", "echo",
                              "stream", "stream_options", "presence_penalty", "repeat_penalty", "max_tokens",
                              "max_completion_tokens", "top_logprobs", "messages", "prompt", "unknown_field"])
            body[key] = rng.choice(ODD_VALUES + [0.5, 1, 2, 20, 100000])
        elif body:
            body.pop(rng.choice(list(body)))
    raw = json.dumps(body, allow_nan=True).encode("utf-8", errors="surrogatepass")
    if rng.random() < 0.1:                           # broken JSON
        raw = raw[:rng.randint(0, len(raw))] + rng.choice([b"", b"}", b"\xff\xfe", b"[" * 2000])
    method = "POST" if rng.random() < 0.95 else rng.choice(["GET", "PUT", "DELETE", "PATCH"])
    if rng.random() < 0.03:
        path = rng.choice(["/v1/nothing", "/v1/completions/../x", "/%00", "/v1/models/x"])
    return method, path, raw


def bad_answer(r) -> bool:
    """A 5xx, or a 4xx without an OpenAI error body."""
    if r.status_code >= 500:
        return True
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
            return set(err) != {"message", "type", "param", "code"} or not err["message"]
        except Exception:
            return True
    return False
