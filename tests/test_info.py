"""`engine info` on the two real models."""
import re
import subprocess
import sys

import pytest

EXPECTED = {
    "smollm2-135m": dict(block_count=30, embedding_length=576, head_count=9, head_count_kv=3, vocab=49152,
                         types={"Q4_1", "Q8_0", "F32"}),
    "gemma3-270m": dict(block_count=18, embedding_length=640, head_count=4, head_count_kv=1, vocab=262144,
                        types={"Q4_K", "Q6_K", "Q5_0", "Q8_0", "F32"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(EXPECTED))
def test_engine_info(name, model_path):
    model_path("smol" if name.startswith("smol") else "gemma")
    r = subprocess.run([sys.executable, "-m", "engine.cli", "info", name], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out, exp = r.stdout, EXPECTED[name]
    for key in ("block_count", "embedding_length", "head_count", "head_count_kv"):
        assert re.search(rf"^\s+{key}:\s+{exp[key]}$", out, re.M), key
    assert f"{exp['vocab']} tokens" in out
    types = set(re.findall(r"^\s+([A-Z0-9_]+)\s+\d+ tensors", out, re.M))
    assert types == exp["types"]
