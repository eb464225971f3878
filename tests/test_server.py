"""The OpenAI-compatible server: a real uvicorn process on loopback, driven by the openai client and raw HTTP."""
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra) -> tuple[subprocess.Popen, str]:
    """`engine serve` on a free port, healthy; its stderr goes to a file (proc.log_path), never a pipe that fills."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="engine-serve-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "smollm2-135m", "--port", str(port),
                             "--device", "cpu", "--ctx", "256", "--ubatch", "64", *extra],
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log_path = log.name
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {open(log.name).read()[-3000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("server did not become healthy")


@pytest.fixture(scope="module")
def server(model_path):
    model_path("smol")
    proc, base = start_server("--parallel", "4", "--ctx", "1024")     # room for five tools' descriptions
    yield base
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


def generate_cli(prompt, n):
    r = subprocess.run([sys.executable, "-m", "engine.cli", "generate", "smollm2-135m", prompt, "-n", str(n),
                        "--temp", "0", "--ignore-eos", "--device", "cpu", "--ctx", "256", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_greedy_completion_equals_engine_generate(client):
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == generate_cli(PROMPT, 12)["text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 12 and r.usage.total_tokens == 17


def test_streamed_completion_equals_whole(client):
    whole = client.completions.create(prompt=PROMPT, max_tokens=10, temperature=0, model="smollm2-135m")
    chunks = list(client.completions.create(prompt=PROMPT, max_tokens=10, temperature=0, model="smollm2-135m",
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_chat_stream_and_not(client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=12, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=12,
                                                 temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


@pytest.mark.parametrize("stream", [False, True])
def test_stop_strings_never_emitted(client, stream):
    full = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert full.startswith(" Paris.\n\n")
    for stop, expected in [("\n", " Paris."), ("aris", " P"), (".\n\nThe", " Paris")]:  # inside and across tokens
        kw = dict(model="smollm2-135m", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop, "zzz"])
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kw)
            text, reason = r.choices[0].text, r.choices[0].finish_reason
        assert text == expected and reason == "stop", stop


def test_n_choices_and_seed(client):
    kw = dict(model="smollm2-135m", prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=11)
    a = client.completions.create(n=2, **kw)
    b = client.completions.create(n=2, **kw)
    assert sorted(c.index for c in a.choices) == [0, 1]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert a.usage.completion_tokens <= 16 and a.usage.prompt_tokens == 4


def test_logprobs(client):
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 == len(lp.token_logprobs) and all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) == 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 2 for e in content)


def test_echo_and_token_ids_prompt(client, server):
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith(PROMPT)
    ids = httpx.post(server + "/tokenize", json={"content": PROMPT}).json()["tokens"]
    assert ids == [504, 3575, 282, 4649, 314]
    r2 = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=3, temperature=0)
    assert PROMPT + r2.choices[0].text == r.choices[0].text
    back = httpx.post(server + "/detokenize", json={"tokens": ids}).json()["content"]
    assert back == PROMPT


def test_echo_with_logprobs_scores_the_prompt(client, server):
    """OpenAI's echo with logprobs: the prompt's tokens come first in logprobs, the first without a log-prob, each
    other the prompt's next token's after the ones before it; max_tokens 0 scores the prompt alone (how lm-eval's
    loglikelihood asks). A stream of it is refused by name."""
    ids = httpx.post(server + "/tokenize", json={"content": PROMPT}).json()["tokens"]
    r = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=2, temperature=0, echo=True,
                                  logprobs=1, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[:len(ids)] == [len("".join(lp.tokens[:j])) for j in range(len(ids))]
    only = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=0, temperature=0, echo=True,
                                     logprobs=0)
    assert only.choices[0].text == PROMPT and only.usage.completion_tokens == 0
    got = only.choices[0].logprobs.token_logprobs
    assert got[0] is None and got[1:] == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-6)
    stopped = client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                        logprobs=1, stop=[r.choices[0].text[len(PROMPT):]])   # ends on its stop
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].text == PROMPT
    assert stopped.choices[0].logprobs.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:len(ids)],
                                                                                     abs=1e-6)
    streamed = httpx.post(server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "echo": True,
                                                            "logprobs": 1, "stream": True})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]


def test_several_prompts_in_one_completion(client, server):
    """OpenAI's batched prompts: a list of texts (or of token lists) gives n choices per prompt, choice k of prompt
    k // n, each the answer the prompt gets alone; usage counts every prompt once; echo, logprobs and a stream
    follow the same indices; a request for more sequences than the server runs and queues is a 400 naming n."""
    prompts = [PROMPT, "1, 2, 3, 4,", "Water boils at"]
    args = dict(model="smollm2-135m", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **args) for p in prompts]
    both = client.completions.create(prompt=prompts, n=2, **args)
    assert [c.index for c in both.choices] == list(range(6))
    assert [c.text for c in both.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 6 * 4
    ids = [httpx.post(server + "/tokenize", json={"content": p}).json()["tokens"] for p in prompts[:2]]
    scored = client.completions.create(prompt=ids, echo=True, logprobs=1, max_tokens=0, temperature=0,
                                       model="smollm2-135m")
    for c, p, ours in zip(scored.choices, prompts, ids):
        one = client.completions.create(prompt=ours, echo=True, logprobs=1, max_tokens=0, temperature=0,
                                        model="smollm2-135m").choices[0]
        assert c.text == p == one.text and c.logprobs.tokens == one.logprobs.tokens
        assert c.logprobs.token_logprobs[0] is None
        # scored beside the other prompt: float32 products over other rows, equal to the last bits only with
        # --batch-invariant (test_batch_invariance.py)
        assert c.logprobs.token_logprobs[1:] == pytest.approx(one.logprobs.token_logprobs[1:], abs=1e-4)
    chunks = client.completions.create(prompt=prompts[:2], stream=True, echo=True, **args)
    texts = ["", ""]
    for ch in chunks:
        for c in ch.choices:
            texts[c.index] += c.text
    assert texts == [p + a.choices[0].text for p, a in zip(prompts[:2], alone)]
    r = httpx.post(server + "/v1/completions", json={"prompt": [PROMPT] * 140, "n": 2, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = httpx.post(server + "/v1/completions", json={"prompt": [PROMPT, ""], "max_tokens": 1})
    assert r.status_code == 400 and "prompt[1] is empty" in r.json()["error"]["message"]


def test_models_metrics_health(server, client):
    assert httpx.get(server + "/v1/models").json()["data"][0]["id"] == "smollm2-135m"
    client.completions.create(model="smollm2-135m", prompt=PROMPT, max_tokens=4, temperature=0)
    metrics = httpx.get(server + "/metrics").text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line[:1] != "#"}
    for name in ("engine:requests_total", "engine:num_requests_waiting", "engine:generation_tokens_total",
                 "engine:generation_tokens_per_second", "engine:prefill_steps_total",
                 "engine:prefill_step_seconds_total", "engine:decode_step_seconds_total", "engine:core_up"):
        assert name in values, name
    assert values["engine:prefill_steps_total"] >= 1 and values["engine:prefill_step_seconds_total"] > 0
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds"):
        assert values[f"engine:{hist}_count"] >= 1 and values[f'engine:{hist}_bucket{{le="+Inf"}}'] >= 1
    assert httpx.get(server + "/health").json() == {"status": "ok"}


def test_prefix_cache_over_http(server, client):
    """A second chat with the same long system prompt reuses its KV cache: usage.prompt_tokens_details.cached_tokens
    and engine:prefix_cache_hits say so, and the answer is the one a server without the cache gives (the first
    chat's, for the same messages)."""
    def metric(name):
        lines = httpx.get(server + "/metrics").text.splitlines()
        return float(next(line.split()[1] for line in lines if line.startswith(name + " ")))
    system = {"role": "system", "content": "You are a careful assistant. " * 12}
    hits = metric("engine:prefix_cache_hits_total")
    first = client.chat.completions.create(model="smollm2-135m", max_tokens=5, temperature=0,
                                           messages=[system, {"role": "user", "content": "Name a colour."}])
    second = client.chat.completions.create(model="smollm2-135m", max_tokens=5, temperature=0,
                                            messages=[system, {"role": "user", "content": "Name a fruit."}])
    again = client.chat.completions.create(model="smollm2-135m", max_tokens=5, temperature=0,
                                           messages=[system, {"role": "user", "content": "Name a colour."}])
    assert second.usage.prompt_tokens_details.cached_tokens >= 60
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    assert again.choices[0].message.content == first.choices[0].message.content
    assert metric("engine:prefix_cache_hits_total") >= hits + 2
    assert metric("engine:prompt_tokens_cached_total") > 0


def test_llama_server_completion_endpoint(server):
    """llama-server's /completion: greedy content equal to /v1/completions', its stream the same text in bare JSON
    events ending with stop true, n_probs candidates, a stop word reported as one, n_predict -1 running to the end
    of generation or the context, pairs as logit_bias."""
    body = {"prompt": "The capital of France is", "temperature": 0}
    ref = httpx.post(server + "/v1/completions", json={**body, "max_tokens": 8}).json()["choices"][0]["text"]
    r = httpx.post(server + "/completion", json={**body, "n_predict": 8, "n_probs": 3}).json()
    assert r["content"] == ref and r["stop"] and r["stop_type"] == "limit" and r["tokens_predicted"] == 8
    assert r["tokens_evaluated"] == len(httpx.post(server + "/tokenize", json={
        "content": body["prompt"], "add_special": True}).json()["tokens"])
    probs, r_tokens = r["completion_probabilities"], r["tokens"]
    assert len(probs) == 8 and all(len(p["top_logprobs"]) == 3 and p["logprob"] <= 0 for p in probs)
    events = []
    with httpx.stream("POST", server + "/completion", json={**body, "n_predict": 8, "stream": True}) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert "".join(ev["content"] for ev in events) == ref and events[-1]["stop"] and not events[0]["stop"]
    words = ref.split()
    r = httpx.post(server + "/completion", json={**body, "n_predict": 8, "stop": [words[1]]}).json()
    assert r["stop_type"] == "word" and r["stopping_word"] == words[1] and words[1] not in r["content"]
    r = httpx.post(server + "/completion", json={"prompt": "Hi", "n_predict": -1, "seed": 1},   # up to 1,024 tokens
                   timeout=300).json()
    assert r["stop_type"] in ("eos", "limit") and r["tokens_predicted"] >= 1
    first = probs[0]["id"]
    assert r_tokens[0] == first
    r = httpx.post(server + "/completion", json={**body, "n_predict": 2, "logit_bias": [[first, -100]]}).json()
    assert r["tokens"][0] != first


def test_logit_bias(server):
    """-100 on the greedy first token changes it (OpenAI's string keys); ids outside the vocabulary, non-numeric
    keys and biases past 100 are a 400 naming logit_bias."""
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    r = httpx.post(server + "/v1/completions", json={**body, "logprobs": 0}).json()
    first = httpx.post(server + "/tokenize", json={"content": r["choices"][0]["logprobs"]["tokens"][0],
                                                   "parse_special": False}).json()["tokens"]
    biased = httpx.post(server + "/v1/completions", json={**body, "logit_bias": {str(first[0]): -100}}).json()
    assert biased["choices"][0]["text"] != r["choices"][0]["text"]
    assert not biased["choices"][0]["text"].startswith(r["choices"][0]["logprobs"]["tokens"][0])
    for bias in ({"49152": 1}, {"x": 1}, {"5": 101}):
        e = httpx.post(server + "/v1/completions", json={**body, "logit_bias": bias})
        assert e.status_code == 400 and e.json()["error"]["param"] == "logit_bias", e.text


FUNCTIONS = [
    {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"],
        "additionalProperties": False}},
    {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100}, "b": {"type": "integer", "minimum": -100,
                                                                          "maximum": 100}},
        "required": ["a", "b"], "additionalProperties": False}},
    {"name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 30},
                                                                       "limit": {"type": "integer", "minimum": 1,
                                                                                 "maximum": 10}},
                                      "required": ["query"], "additionalProperties": False}},
    {"name": "set_alarm", "parameters": {"type": "object", "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23}, "minute": {"type": "integer", "minimum": 0,
                                                                             "maximum": 59}},
        "required": ["hour", "minute"], "additionalProperties": False}},
    {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
]
TOOLS = [{"type": "function", "function": f} for f in FUNCTIONS]


def check_calls(calls, names=None):
    import jsonschema
    schemas = {f["name"]: f["parameters"] for f in FUNCTIONS}
    assert calls, "no tool call"
    for c in calls:
        name = c.function.name if hasattr(c, "function") else c["function"]["name"]
        args = c.function.arguments if hasattr(c, "function") else c["function"]["arguments"]
        assert name in (names or schemas)
        jsonschema.validate(json.loads(args), schemas[name])


def test_tool_calls(server, client):
    """tool_choice required with 5 functions at temperature 1.0: every reply is a valid call of one of them,
    streamed and not; a named function is that function; a conversation carrying a call and its result renders;
    malformed tools and choices are a 400 naming the field."""
    messages = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
    for seed in range(4):
        r = client.chat.completions.create(model="smollm2-135m", messages=messages, tools=TOOLS, tool_choice="required",
                                           temperature=1.0, seed=seed, max_tokens=80)
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(r.choices[0].message.tool_calls)
    calls, pieces = {}, {}
    for chunk in client.chat.completions.create(model="smollm2-135m", messages=messages, tools=TOOLS,
                                                tool_choice="required", temperature=1.0, seed=9, max_tokens=80,
                                                stream=True):
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            calls.setdefault(tc.index, {"function": {"name": "", "arguments": ""}})
            calls[tc.index]["function"]["name"] += tc.function.name or ""
            calls[tc.index]["function"]["arguments"] += tc.function.arguments or ""
            pieces[tc.index] = pieces.get(tc.index, 0) + bool(tc.function.arguments)
    check_calls(list(calls.values()))
    assert pieces and all(n > 1 for n in pieces.values())   # the arguments streamed as they were written
    r = client.chat.completions.create(model="smollm2-135m", messages=messages, tools=TOOLS, max_tokens=60,
                                       tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0)
    check_calls(r.choices[0].message.tool_calls, {"add"})
    call = r.choices[0].message.tool_calls[0]
    follow = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "add", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    r = client.chat.completions.create(model="smollm2-135m", messages=follow, tools=TOOLS, max_tokens=8,
                                       temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    for extra, param in [({"tools": "x"}, "tools"), ({"tools": [{"type": "function"}]}, "tools"),
                         ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                          "tool_choice"), ({"tool_choice": "required"}, "tool_choice")]:
        e = httpx.post(server + "/v1/chat/completions", json={"messages": messages, **extra})
        assert e.status_code == 400 and e.json()["error"]["param"] == param, e.text


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def test_structured_output(server, client):
    """response_format json_schema (streamed and not, temperature 1.0) and json_object, llama-server's json_schema
    and GBNF grammar fields: outputs that parse and validate; malformed ones a 400 naming the field."""
    import jsonschema
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Invent a person."}]
    for seed in range(3):
        r = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=60, temperature=1.0,
                                           seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    chunks = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=60,
                                            temperature=1.0, seed=7, response_format=fmt, stream=True)
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), PERSON)
    r = client.chat.completions.create(model="smollm2-135m", max_tokens=100, temperature=0,
                                       messages=[{"role": "user", "content": "Describe a cat as a JSON object."}],
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = httpx.post(server + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 10,
                                                     "temperature": 0, "grammar": 'root ::= " Paris" | " Rome"'})
    assert r.json()["choices"][0]["text"] in (" Paris", " Rome")
    r = httpx.post(server + "/v1/completions", json={"prompt": "Age:", "max_tokens": 60, "json_schema": PERSON},
                   timeout=120)
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), PERSON)
    for field, value in [("response_format", {"type": "xml"}), ("response_format", {"type": "json_schema"}),
                         ("grammar", "root ::= ["), ("json_schema", {"$ref": "#/nowhere"}), ("grammar", 5)]:
        r = httpx.post(server + "/v1/completions", json={"prompt": "x", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


def test_concurrent_requests_share_a_system_prompt_once(server):
    """Eight concurrent chats with one long system prompt and different questions: the prefix is prefilled once
    and copied to the other seven (engine:prompt_tokens_cached); asked again, a question gets the same greedy answer
    (tests/test_scheduler.py compares the cache on and off)."""
    import concurrent.futures

    def metric(name):
        lines = httpx.get(server + "/metrics").text.splitlines()
        return float(next(line.split()[1] for line in lines if line.startswith(name + " ")))
    system = {"role": "system", "content": "You answer in one short sentence about animals and plants. " * 8}
    questions = [f"Tell me about animal number {i}." for i in range(8)]

    def ask(q):
        r = httpx.post(server + "/v1/chat/completions", timeout=120, json={
            "messages": [system, {"role": "user", "content": q}], "max_tokens": 6, "temperature": 0})
        return r.json()
    cached = metric("engine:prompt_tokens_cached_total")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, questions))
    shared = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
    assert sorted(shared)[1] >= 100 and metric("engine:prompt_tokens_cached_total") - cached >= 7 * 100, shared
    again = [ask(q)["choices"][0]["message"]["content"] for q in questions[:2]]
    assert again == [a["choices"][0]["message"]["content"] for a in answers[:2]]


@pytest.mark.parametrize("body,status,param", [
    ('{"prompt": "x", "max_tokens": ', 400, None),                                   # malformed JSON
    ('{"prompt": "x", "max_tokens": "many"}', 400, "max_tokens"),
    ('{"prompt": "x", "temperature": 9}', 400, "temperature"),
    ('{"max_tokens": 4}', 400, "prompt"),
    ('{"prompt": "x", "max_tokens": 100000}', 400, "max_tokens"),                    # over the context
    ('{"prompt": "x", "model": "gpt-9"}', 404, "model"),
])
def test_errors(server, body, status, param):
    r = httpx.post(server + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert err["message"] and err["param"] == param and err["code"] == status


@pytest.mark.parametrize("path,field,value", [
    ("/v1/completions", "n_probs", 5),
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", "}"),
    ("/v1/chat/completions", "typical_p", 0.9),
    ("/v1/completions", "mirostat", 2),
    ("/v1/completions", "dry_multiplier", 0.8),
    ("/v1/completions", "xtc_probability", 0.5),
    ("/v1/completions", "top_n_sigma", 1.5),
    ("/v1/chat/completions", "min_tokens", 4),
    ("/v1/completions", "stop_token_ids", [5]),
])
def test_fields_that_cannot_be_honoured_are_refused(server, path, field, value):
    """A field that would change the output and is not implemented gets a 400 naming it, never a silent answer."""
    body = {"max_tokens": 2, field: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
    r = httpx.post(server + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]


def test_harmless_fields_are_accepted(server):
    r = httpx.post(server + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tool_choice": "none", "tools": [],
        "response_format": {"type": "text"}, "user": "u-1", "logit_bias": {}, "metadata": {"k": "v"},
        "typical_p": 1.0, "mirostat": 0, "min_tokens": 0, "stop_token_ids": [], "top_n_sigma": -1,
        "include_stop_str_in_output": False})
    assert r.status_code == 200, r.text


def test_repetition_penalty_is_vllms_name_for_repeat_penalty(server):
    """vLLM's repetition_penalty is honoured as repeat_penalty over every token so far (repeat_last_n -1): the same
    greedy text, different from no penalty; both names at once is a 400."""
    def text(**kw):
        r = httpx.post(server + "/v1/completions", json={"prompt": "la la la la la la la", "max_tokens": 12,
                                                         "temperature": 0, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    vllm = text(repetition_penalty=1.5)
    assert vllm == text(repeat_penalty=1.5, repeat_last_n=-1) and vllm != text()
    r = httpx.post(server + "/v1/completions", json={"prompt": "x", "repeat_penalty": 1.1, "repetition_penalty": 1.2})
    assert r.status_code == 400 and "repetition_penalty" in r.json()["error"]["message"]
    r = httpx.post(server + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "best_of": 1, "suffix": ""})
    assert r.status_code == 200, r.text


def test_props_and_open_metrics(server):
    props = httpx.get(server + "/props").json()
    assert props["total_slots"] == 4 and props["n_ctx"] == 1024 and "im_start" in props["chat_template"]
    assert props["default_generation_settings"]["params"]["temperature"] == 1.0


def test_model_by_id_and_metrics_help(server):
    r = httpx.get(server + "/v1/models/smollm2-135m")
    assert r.status_code == 200 and r.json()["id"] == "smollm2-135m"
    r = httpx.get(server + "/v1/models/gpt-9")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    lines = httpx.get(server + "/metrics").text.splitlines()
    typed = [ln.split()[2] for ln in lines if ln.startswith("# TYPE")]
    helped = [ln.split()[2] for ln in lines if ln.startswith("# HELP")]
    assert typed and typed == helped


def test_chat_template_kwargs(server):
    """chat_template_kwargs (vLLM's and llama-server's field) reach the template; a name the request itself gives, or
    one that is not a name, is a 400 naming the field."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
    r = httpx.post(server + "/v1/chat/completions", json={**chat, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    for kwargs in ({"messages": []}, {"not a name": 1}, [1]):
        r = httpx.post(server + "/v1/chat/completions", json={**chat, "chat_template_kwargs": kwargs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", r.text


def test_chat_errors(server):
    r = httpx.post(server + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(server + "/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400


def test_api_key(model_path):
    model_path("smol")
    proc, base = start_server("--api-key", "sekret", "--parallel", "1", "--metrics-key", "scrape")
    try:
        assert httpx.get(base + "/health").status_code == 200
        assert httpx.get(base + "/v1/models").status_code == 401
        assert httpx.get(base + "/props").status_code == 401
        assert httpx.get(base + "/metrics").status_code == 401
        assert httpx.get(base + "/metrics", headers={"authorization": "Bearer sekret"}).status_code == 401
        assert httpx.get(base + "/metrics", headers={"authorization": "Bearer scrape"}).status_code == 200
        assert httpx.get(base + "/v1/models", headers={"authorization": "Bearer wrong"}).status_code == 401
        r = httpx.post(base + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                       headers={"authorization": "Bearer sekret"})
        assert r.status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def stream_tokens(server, prompt, max_tokens, results, i, stop_after=None):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7, "seed": i, "stream": True,
            "extra": 1, "ignore_eos": True}
    pieces, done = [], False
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: ")
            if line == "data: [DONE]":
                done = True
                break
            obj = json.loads(line[6:])
            pieces.append(obj["choices"][0])
            if stop_after is not None and len(pieces) >= stop_after:
                break                                              # disconnect mid-stream
    results[i] = (pieces, done)


def test_concurrent_clients_and_disconnect(server):
    results = {}
    threads = [threading.Thread(target=stream_tokens, args=(server, f"Story {i}:", 10, results, i,
                                                            3 if i == 5 else None)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 16
    for i, (pieces, done) in results.items():
        if i == 5:
            assert len(pieces) == 3 and not done
            continue
        assert done, i
        assert pieces[-1]["finish_reason"] == "length" and sum(1 for p in pieces if p["text"]) >= 1
    deadline = time.time() + 30                                     # the queue drains and every slot is freed
    while time.time() < deadline:
        m = dict(line.split() for line in httpx.get(server + "/metrics").text.splitlines()
                 if line and not line.startswith("#"))
        if float(m["engine:num_requests_running"]) == 0 and float(m["engine:num_requests_waiting"]) == 0 \
                and float(m["engine:kv_slots_free"]) == 4:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"server did not drain: {m}")
    r = httpx.post(server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})   # capacity is reused
    assert r.status_code == 200


def test_degenerate_sampling_requests_keep_the_server_serving(server):
    for extra in ({"temperature": 1e-310}, {"seed": -1, "temperature": 1.0}, {"seed": 2 ** 70}):
        r = httpx.post(server + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **extra}, timeout=60)
        assert r.status_code == 200, (extra, r.text)
    r = httpx.post(server + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"].startswith(" Paris")


def test_llama_server_flags_cors_and_graceful_shutdown(model_path, tmp_path):
    """llama-server's flags are accepted (-m, -c, -np, -ngl 0 for the CPU, --jinja); --cors answers a browser's
    preflight even with an API key; Ctrl-C with a stream open ends the stream with finish_reason "abort" and
    [DONE], and the server exits 0 at once, without a traceback."""
    import signal
    model_path("smol")
    port = free_port()
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "serve", "-m", "smollm2-135m", "-c", "256", "-np",
                             "2", "-ngl", "0", "--jinja", "--cors", "--api-key", "k", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=log, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        pre = httpx.options(base + "/v1/chat/completions", headers={
            "origin": "http://page.example", "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
        got = []

        def stream():
            try:
                with httpx.stream("POST", base + "/v1/completions", headers={"authorization": "Bearer k"}, json={
                        "prompt": "Once", "max_tokens": 200, "stream": True, "ignore_eos": True}, timeout=60) as r:
                    for line in r.iter_lines():
                        got.append(line)
            except httpx.HTTPError:
                pass
        th = threading.Thread(target=stream, daemon=True)
        th.start()
        while not any(line.startswith("data: {") for line in got) and th.is_alive():
            time.sleep(0.05)
        t0 = time.time()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=15) == 0
        assert time.time() - t0 < 3
        th.join(5)
        chunks = [json.loads(line[6:]) for line in got if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort" and got[-2:] == ["data: [DONE]", ""]
    finally:
        if proc.poll() is None:
            proc.kill()
    log.seek(0)
    assert "Traceback" not in log.read()


def test_more_sequences_than_whole_contexts_in_kv_memory(model_path):
    """--kv-memory sized for 4 whole 256-token contexts serves 16 concurrent streams (--parallel 16), 0 errors;
    /metrics reports the blocks in use while they run and none after."""
    model_path("smol")
    per_token = 2 * 30 * 3 * 64 * 4                     # SmolLM2's f32 keys and values of one position
    proc, base = start_server("--parallel", "16", "--kv-memory", str(4 * 256 * per_token / 2**30))
    try:
        results = {}
        threads = [threading.Thread(target=stream_tokens, args=(base, f"Story {i}:", 40, results, i))
                   for i in range(16)]
        for t in threads:
            t.start()
        usage = 0.0
        while any(t.is_alive() for t in threads):
            text = httpx.get(base + "/metrics").text
            usage = max(usage, float(next(line.split()[1] for line in text.splitlines()
                                          if line.startswith("engine:kv_cache_usage_perc "))))
            time.sleep(0.2)
        assert len(results) == 16 and all(done and pieces[-1]["finish_reason"] == "length"
                                          for pieces, done in results.values())
        assert usage > 0.25
        text = httpx.get(base + "/metrics").text
        assert "engine:kv_cache_usage_perc 0.0" in text and "engine:kv_slots_free 16.0" in text
    finally:
        proc.terminate()
        proc.wait(timeout=10)
