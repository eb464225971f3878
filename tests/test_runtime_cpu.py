"""The CPU runtime end to end: fidelity against llama.cpp, greedy-32, ubatch invariance, the CLI."""
import json
import subprocess
import sys

import pytest

from conftest import DATA, GOLDEN, MODEL_KEYS, read_golden, read_prompts
from engine.logprobs import compare, read_lp, top_k_logprobs
from engine.runtime import ContextLengthError, Runtime
from engine.sampling import SamplingParams

pytestmark = pytest.mark.slow
_runtimes = {}


def runtime(model_path, key, **kw) -> Runtime:
    k = (key, tuple(sorted(kw.items())))
    if k not in _runtimes:
        model_path(key)
        _runtimes[k] = Runtime.load(MODEL_KEYS[key], device="cpu", **kw)
    return _runtimes[k]


def greedy32(rt, prompt):
    return list(rt.generate(rt.tokenizer.encode(prompt), SamplingParams(temperature=0), 32, ignore_eos=True))


_greedy = {}   # (key, prompt, runtime arguments) -> greedy32's tokens: tests that ask the same share one run


def greedy32_of(model_path, key, prompt, **kw):
    k = (key, prompt, tuple(sorted(kw.items())))
    if k not in _greedy:
        _greedy[k] = greedy32(runtime(model_path, key, **kw), prompt)
    return _greedy[k]


FIDELITY_BOUNDS = {"smol": (0.960, 0.0040), "gemma": (0.955, 0.0055)}


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_fidelity_against_llamacpp_cpu(model_path, key):
    rt = runtime(model_path, key, n_ctx=4096)
    tokens = [int(x) for x in (GOLDEN / f"apache.{key}.tokens").read_text().split()]
    ours = top_k_logprobs(rt.prefill(tokens, all_logits=True))
    result = compare(ours, read_lp(GOLDEN / f"apache.{key}.cpu.lp16.bin"))
    print(key, result)
    top1, kl = FIDELITY_BOUNDS[key]
    assert result["top1"] >= top1 and result["kl_mean"] <= kl


def first_near_tie(margins, bound=0.5):
    return next((i for i, m in enumerate(margins) if m < bound), len(margins))


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_greedy32_matches_llamacpp_and_recorded(model_path, key):
    recorded = json.loads((DATA / "greedy32.cpu.json").read_text())[key]
    for prompt, gold, rec in zip(read_prompts(key), read_golden(key, "cpu"), recorded):
        ours = greedy32_of(model_path, key, prompt, n_ctx=1024)
        n = first_near_tie(gold["margins"])
        assert ours[:n] == gold["tokens"][:n], prompt[:40]
        assert ours == rec, prompt[:40]


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_long_prompt_same_tokens_for_every_ubatch(model_path, key):
    prompt = read_prompts(key)[-1]
    results = [greedy32_of(model_path, key, prompt, n_ctx=1024, **({} if u == 512 else {"n_ubatch": u}))
               for u in (512, 128, 2048)]          # 512: the default (test_greedy32's run, when it ran first)
    assert len(runtime(model_path, key, n_ctx=1024).tokenizer.encode(prompt)) > 512
    assert results[0] == results[1] == results[2]


def test_ubatch_defaults_to_the_backends(model_path):
    from engine.backends.base import Backend
    rt = runtime(model_path, "smol", n_ctx=1024)
    assert rt.n_ubatch == rt.backend.prefill_ubatch == Backend.prefill_ubatch
    with pytest.raises(ValueError, match="n_ubatch must be >= 1"):
        Runtime.load(MODEL_KEYS["smol"], device="cpu", n_ctx=64, n_ubatch=0)
    r = run_cli("bench", model_path("smol"), "-p", "8", "-n", "2", "-r", "1", "--device", "cpu")
    assert r.returncode == 0 and f"| cpu | {Backend.prefill_ubatch} | pp8 |" in r.stdout, r.stdout + r.stderr


def test_prompt_longer_than_context_is_an_error(model_path):
    rt = runtime(model_path, "smol", n_ctx=64)
    with pytest.raises(ContextLengthError, match="more than the context of 64"):
        list(rt.generate(list(range(100, 200)), max_tokens=4))


def test_generation_stops_at_context_end(model_path):
    rt = runtime(model_path, "smol", n_ctx=64)
    out = list(rt.generate(list(range(100, 160)), SamplingParams(temperature=0), max_tokens=50, ignore_eos=True))
    assert len(out) == 5  # positions 60..63 fill the context; the 5th token is sampled from the last logits


def test_exact_mode_agrees_with_float32(model_path):
    f64 = runtime(model_path, "smol", n_ctx=256, exact=True)
    f32 = runtime(model_path, "smol", n_ctx=256)
    tokens = [int(x) for x in (GOLDEN / "apache.smol.tokens").read_text().split()][:200]
    r = compare(top_k_logprobs(f32.prefill(tokens, all_logits=True)),
                top_k_logprobs(f64.prefill(tokens, all_logits=True)))
    assert r["top1"] >= 0.99 and r["kl_mean"] < 1e-4


def run_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_cli_default_model(model_path):
    model_path("smol")
    r = run_cli("generate", "The capital of France is", "-n", "8", "--temp", "0", "--device", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris")


def test_generate_cli_json(model_path):
    r = run_cli("generate", model_path("smol"), "The capital of France is", "-n", "6", "--temp", "0",
                "--ignore-eos", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    gold = read_golden("smol", "cpu")[0]
    assert out["prompt_tokens"] == gold["prompt_tokens"] and out["tokens"][:5] == gold["tokens"][:5]
    assert set(out["timings"]) >= {"prompt_tokens_per_s", "generated_tokens_per_s", "time_to_first_token_s"}


def test_generate_cli_chat(model_path):
    r = run_cli("generate", model_path("smol"), "What is 2+2?", "--chat", "-n", "16", "--temp", "0",
                "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prompt_tokens"][0] == 1 and len(out["tokens"]) > 0  # <|im_start|>


def test_generate_cli_prompt_too_long(model_path):
    r = run_cli("generate", model_path("smol"), "word " * 200, "--ctx", "64", "--device", "cpu")
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "more than the context of 64" in r.stderr


def test_generate_cli_prompt_from_stdin_and_file(model_path, tmp_path):
    """`echo PROMPT | engine generate MODEL`, `generate MODEL -`, `generate MODEL -f FILE` all take the prompt
    (less the newline ending its line) and give what the prompt argument gives."""
    model = model_path("smol")
    opts = ["-n", "4", "--temp", "0", "--ignore-eos", "--device", "cpu", "--json"]
    ref = json.loads(run_cli("generate", *opts, model, "The capital of France is").stdout)
    (tmp_path / "p.txt").write_text("The capital of France is\n")
    for args, stdin in (([model], "The capital of France is\n"), ([model, "-"], "The capital of France is\n"),
                        ([model, "-f", str(tmp_path / "p.txt")], "")):
        r = subprocess.run([sys.executable, "-m", "engine.cli", "generate", *opts, *args], input=stdin,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert out["prompt_tokens"] == ref["prompt_tokens"] and out["tokens"] == ref["tokens"], args


def test_generate_cli_n_and_version(model_path):
    model = model_path("smol")
    r = run_cli("generate", "-n", "-1", "--ctx", "16", "--temp", "0", "--ignore-eos", "--device", "cpu", "--json",
                model, "The capital of France is")
    out = json.loads(r.stdout)
    assert out["finish_reason"] == "length" and len(out["prompt_tokens"]) + len(out["tokens"]) == 17
    r = run_cli("generate", "-n", "-5", model, "x")
    assert r.returncode == 1 and "-n must be" in r.stderr and "Traceback" not in r.stderr
    r = run_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("engine ")
    r = run_cli("generate", "--help")
    assert "(default: 128)" in r.stdout


def test_chat_cli_keeps_the_conversation(model_path):
    """`engine chat`: each stdin line a turn, replies that remember the earlier turns; a message too long for the
    context is one error line and the session goes on; /exit ends it."""
    r = subprocess.run([sys.executable, "-m", "engine.cli", "chat", model_path("smol"), "--temp", "0", "-n", "40",
                        "--device", "cpu", "--ctx", "512"],
                       input="What is the capital of France?\n" + "word " * 600 + "\n"
                             "And what language do they speak there?\n/exit\nnever read\n",
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    replies = [line for line in r.stdout.splitlines() if line.strip()]
    assert len(replies) == 2 and "Paris" in replies[0] and "French" in replies[1]
    assert "does not fit the context of 512" in r.stderr
