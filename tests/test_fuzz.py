"""Crafted and fuzzed GGUF files: every one opens, or fails with one clean line; nothing is accepted silently."""
import subprocess
import sys

import numpy as np
import pytest

from fuzz_gguf import Header, check_file, mutate, write_case
from tiny_models import write_tiny


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    return {a: write_tiny(d / f"{a}.gguf", a) for a in ("llama", "gemma3")}


def with_entry(h: Header, key: str, vtype, value) -> Header:
    h.kv = [e for e in h.kv if e[0] != key] + [[key, vtype, value]]
    return h


def without(h: Header, key: str) -> Header:
    h.kv = [e for e in h.kv if e[0] != key]
    return h


U32, I32, F32, STR = (4, None), (5, None), (6, None), (8, None)
CASES = {   # name: (change to the tiny llama's header, words the error must contain)
    "head_count 0": (lambda h: with_entry(h, "llama.attention.head_count", U32, 0), "head_count"),
    "block_count an array": (lambda h: with_entry(h, "llama.block_count", (9, 4), [3, 3]), "not an integer"),
    "block_count 0": (lambda h: with_entry(h, "llama.block_count", U32, 0), "block_count"),
    "block_count -1": (lambda h: with_entry(h, "llama.block_count", I32, -1), "block_count"),
    "embedding_length a string": (lambda h: with_entry(h, "llama.embedding_length", STR, "256"), "not an integer"),
    "rope.freq_base an array": (lambda h: with_entry(h, "llama.rope.freq_base", (9, 6), [1.0]), "not a number"),
    "rope.freq_base NaN": (lambda h: with_entry(h, "llama.rope.freq_base", F32, float("nan")), "freq_base"),
    "epsilon inf": (lambda h: with_entry(h, "llama.attention.layer_norm_rms_epsilon", F32, float("inf")),
                    "epsilon"),
    "alignment an array": (lambda h: with_entry(h, "general.alignment", (9, 4), [32]), "alignment"),
    "rope dims 2^32-1": (lambda h: with_entry(h, "llama.rope.dimension_count", U32, 2 ** 32 - 1),
                         "rope.dimension_count"),
    "token types of the wrong length": (lambda h: with_entry(h, "tokenizer.ggml.token_type", (9, 5), [1, 1]),
                                        "token_type"),
    "tokens not strings": (lambda h: with_entry(h, "tokenizer.ggml.tokens", (9, 5), [1, 2]), "tokens"),
    "tokenizer model an array": (lambda h: with_entry(h, "tokenizer.ggml.model", (9, 4), [88, 99]),
                                 "unsupported tokenizer model"),
    "add_bos an array": (lambda h: with_entry(h, "tokenizer.ggml.add_bos_token", (9, 4), [1, 0]), "add_bos_token"),
    "bos outside the vocabulary": (lambda h: with_entry(h, "tokenizer.ggml.bos_token_id", U32, 10 ** 6),
                                   "outside the vocabulary"),
    "vocabulary shorter than the table": (lambda h: with_entry(without(h, "tokenizer.ggml.token_type"),
                                                               "tokenizer.ggml.tokens", (9, 8),
                                                               [f"t{i}" for i in range(100)]), "vocab_size"),
    "duplicate key": (lambda h: setattr(h, "kv", h.kv + [h.kv[1]]) or h, "appears twice"),
    "duplicate tensor": (lambda h: setattr(h, "tensors", h.tensors + [h.tensors[0]]) or h, "appears twice"),
    "overlapping tensors": (lambda h: h.tensors[1].__setitem__(3, h.tensors[0][3]) or h, "overlap"),
    "unsupported architecture with escapes": (lambda h: [with_entry(h, k.replace("llama.", "\x1b[2Jmamba."), t, v)
                                                         for k, t, v in list(h.kv) if k.startswith("llama.")] and
                                              with_entry(h, "general.architecture", STR, "\x1b[2Jmamba"),
                                              "unsupported architecture"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_crafted_file_gives_one_clean_line(tiny, tmp_path, case):
    change, words = CASES[case]
    h = Header.read(tiny["llama"])
    path = tmp_path / "case.gguf"
    write_case(path, (change(h).to_bytes(), None), tiny["llama"], Header.read(tiny["llama"]))
    assert check_file(path) is None
    r = subprocess.run([sys.executable, "-m", "engine.cli", "generate", str(path), "hi", "-n", "2", "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and "\x1b" not in lines[0], lines
    assert len(lines[0]) - len(str(path)) < 320


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_fuzzed_tiny_models(tiny, tmp_path, arch):
    """200 random mutations each, loaded and run for 2 tokens on the CPU: no error outside the engine's own."""
    src = tiny[arch]
    h = Header.read(src)
    rng = np.random.default_rng()
    seed = int(rng.integers(0, 2 ** 31))
    rng = np.random.default_rng(seed)
    for i in range(200):
        path = tmp_path / "case.gguf"
        write_case(path, mutate(h, rng), src, h)
        problem = check_file(path, generate=True)
        assert problem is None, (seed, i, problem)


@pytest.mark.slow
def test_fuzzed_real_model_headers(model_path, tmp_path):
    """30 mutations of SmolLM2's header (the tensor data kept), loaded with the shape checks."""
    src = model_path("smol")
    h = Header.read(src)
    seed = int(np.random.default_rng().integers(0, 2 ** 31))
    rng = np.random.default_rng(seed)
    for i in range(30):
        path = tmp_path / "case.gguf"
        write_case(path, mutate(h, rng), src, h)
        assert check_file(path) is None, (seed, i)
