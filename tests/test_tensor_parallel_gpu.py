"""Tensor parallelism on GPUs: one process per GPU, NCCL between, against the same model on one GPU."""
import numpy as np
import pytest

from conftest import read_prompts
from engine.runtime import Runtime
from engine.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def n_gpus() -> int:
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


def margins_and_tokens(rt, prompt, n):
    """Greedy tokens through the decode path and each step's margin between its best two logits."""
    logits = rt.prefill(prompt)[-1]
    toks, margins = [], []
    for i in range(n):
        top2 = np.sort(logits)[-2:]
        margins.append(float(top2[1] - top2[0]))
        toks.append(int(np.argmax(logits)))
        logits = rt.decode([0], [toks[-1]], [len(prompt) + i])[0]
    return toks, margins


def mean_kl(p_logits, q_logits) -> float:
    """Mean over rows of KL(softmax p || softmax q)."""
    def logsm(x):
        x = x.astype(np.float64) - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))
    lp, lq = logsm(p_logits), logsm(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum(axis=1).mean())


def split_and_one(model_path, key):
    if n_gpus() < 2:
        pytest.skip("needs 2 GPUs")
    return (Runtime.load(model_path(key), device="cuda", n_ctx=1024),
            Runtime.load(model_path(key), device="cuda", n_ctx=1024, tensor_parallel=2))


@pytest.mark.parametrize("key", ["smol", "gemma"])
def test_split_over_two_gpus_stays_near_one(model_path, key):
    """No gross error in the split: teacher-forced through TP = 1's greedy tokens, TP = 2's logits stay within 3 of
    TP = 1's at every step (measured 0.4-1.6 on the H200, the rounding of two q8_1 paths; a wrong shard or a lost
    all-reduce gives errors that grow step by step), and the prefill's mean KL is under 0.01."""
    one, two = split_and_one(model_path, key)
    for text in read_prompts(key):
        prompt = one.tokenizer.encode(text)
        a, b = one.prefill(prompt, all_logits=True), two.prefill(prompt, all_logits=True)
        assert mean_kl(a, b) <= 0.01, text[:40]
        a, b = a[-1], b[-1]
        for i in range(32):
            assert np.abs(a - b).max() <= 3.0, (text[:40], i)
            t = int(np.argmax(a))
            a = one.decode([0], [t], [len(prompt) + i])[0]
            b = two.decode([0], [t], [len(prompt) + i])[0]
    prompt = one.tokenizer.encode(read_prompts(key)[0])
    assert len(list(two.generate(prompt, SamplingParams(temperature=0), 16, ignore_eos=True))) == 16   # graphs too
    two.backend.close()


GEMMA_DIVERGES = pytest.mark.xfail(strict=True, reason="issue 31's acceptance, not met on Gemma 3: TP = 2 rounds "
                                   "differently from TP = 1 (attention split, all-reduce order), q8_1 activations "
                                   "amplify it, and 'def fibonacci' leaves TP = 1's tokens at step 3 (margin >= 0.5)")


@pytest.mark.parametrize("key", ["smol", pytest.param("gemma", marks=GEMMA_DIVERGES)])
def test_split_over_two_gpus_greedy_equals_one(model_path, key):
    """Greedy-32 at TP = 2 identical to TP = 1 up to TP = 1's first near tie (margin under 0.5)."""
    one, two = split_and_one(model_path, key)
    for text in read_prompts(key):
        prompt = one.tokenizer.encode(text)
        toks_1, margins = margins_and_tokens(one, prompt, 32)
        toks_2, _ = margins_and_tokens(two, prompt, 32)
        n = next((i for i, m in enumerate(margins) if m < 0.5), 32)
        assert toks_2[:n + 1] == toks_1[:n + 1], text[:40]
    two.backend.close()
