"""llama-server's /infill on a model with fill-in-the-middle tokens (a tiny file whose vocabulary has StarCoder's),
and its clear refusal on one without them (SmolLM2)."""
import subprocess
import sys
import time

import httpx
import pytest

from engine.gguf import GGUFFile
from engine.tokenizer import Tokenizer
from server.messages import HEARTBEAT_S
from test_server import free_port
from tiny_archs import write_arch


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    path = write_arch(tmp_path_factory.mktemp("infill") / "tiny.gguf", "qwen3")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", path, "--port", str(port), "--device", "cpu",
                             "--ctx", "256", "--parallel", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        proc.kill()
        raise RuntimeError("server did not become healthy")
    yield base, Tokenizer(GGUFFile(path))
    proc.terminate()
    proc.wait(timeout=10)


def test_infill_builds_the_fim_prompt(tiny_server):
    """<PRE> prefix <SUF> suffix <MID> prompt, other files first after <file_sep> when the vocabulary has one (this one
    does not: their text goes first): the same tokens as /completion given those ids, the same greedy continuation."""
    base, tok = tiny_server
    body = {"input_prefix": "def add(a, b):\n    return ", "input_suffix": "\n\nprint(add(1, 2))\n", "prompt": "a",
            "input_extra": [{"filename": "util.py", "text": "X = 1\n"}], "n_predict": 6, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(base + "/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    enc = lambda s: tok.encode(s, add_special=False)  # noqa: E731
    ids = (enc("X = 1\n") + [tok.fim["pre"]] + enc(body["input_prefix"]) + [tok.fim["suf"]]
           + enc(body["input_suffix"]) + [tok.fim["mid"]] + enc("a"))
    out = r.json()
    assert out["tokens_evaluated"] == len(ids) and out["tokens_predicted"] == 6
    same = httpx.post(base + "/completion", json={"prompt": ids, "n_predict": 6, "temperature": 0,
                                                  "ignore_eos": True}, timeout=60).json()
    assert same["content"] == out["content"] and same["tokens_evaluated"] == len(ids)


def test_infill_streams(tiny_server):
    base, _ = tiny_server
    with httpx.stream("POST", base + "/infill", json={"input_prefix": "x = ", "input_suffix": "\n", "n_predict": 4,
                                                      "ignore_eos": True, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events and '"stop": true' in events[-1].replace('"stop":true', '"stop": true')


@pytest.mark.slow
def test_infill_refused_without_fim_tokens(model_path):
    """SmolLM2 has no fill-in-the-middle tokens: a 400 in OpenAI's error shape naming them."""
    from test_server import start_server
    model_path("smol")
    proc, base = start_server("--parallel", "1")
    try:
        r = httpx.post(base + "/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=30)
        assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"], r.text
        assert "fim_pre" in r.json()["error"]["message"]
        r = httpx.post(base + "/infill", json={"input_prefix": 3}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_slots_show_each_kv_slot(tiny_server):
    """llama-server's /slots: one entry per KV slot; a long generation shows up as processing, then the slot is free."""
    import threading
    base, _ = tiny_server
    slots = httpx.get(base + "/slots", timeout=10).json()
    assert [s["id"] for s in slots] == [0, 1] and not any(s["is_processing"] for s in slots)
    assert all(s["n_ctx"] == 256 for s in slots)
    done = threading.Event()
    first_chunk = threading.Event()

    def generate():                                   # streamed: the slot is asked for once the first token is out
        with httpx.stream("POST", base + "/completion", json={"prompt": "hello", "n_predict": 200,
                                                               "ignore_eos": True, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    first_chunk.set()
        done.set()
    threading.Thread(target=generate, daemon=True).start()
    assert first_chunk.wait(30)
    seen = []
    while not seen and not done.is_set():
        seen += [s for s in httpx.get(base + "/slots", timeout=10).json() if s["is_processing"]]
    while not done.is_set():
        seen += [s for s in httpx.get(base + "/slots", timeout=10).json() if s["is_processing"]]
        time.sleep(0.02)
    assert seen, "the generating request never showed in /slots"
    assert seen[0]["n_prompt_tokens"] == 5 and seen[-1]["n_past"] >= seen[0]["n_past"]
    assert done.wait(60)
    deadline = time.time() + 3 * HEARTBEAT_S              # a heartbeat at the latest carries the free slot
    while any(s["is_processing"] for s in httpx.get(base + "/slots", timeout=10).json()):
        assert time.time() < deadline, "the slot stayed busy after its request ended"
        time.sleep(0.05)
