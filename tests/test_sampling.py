"""Sampling: greedy, seeds, top-k/top-p/min-p filters, penalties."""
import numpy as np
import pytest

from engine.sampling import Sampler, SamplingParams


def logits(n=100, seed=None):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 3


def test_greedy_is_argmax():
    x = logits()
    assert Sampler(SamplingParams(temperature=0))(x) == int(np.argmax(x))


def test_seed_reproducible():
    x = logits()
    a = [Sampler(SamplingParams(temperature=1.0, seed=7))(x) for _ in range(5)]
    s1, s2 = Sampler(SamplingParams(temperature=1.0, seed=7)), Sampler(SamplingParams(temperature=1.0, seed=7))
    assert [s1(x) for _ in range(20)] == [s2(x) for _ in range(20)]
    assert len(set(a)) == 1


def test_top_k_one_is_greedy():
    x = logits()
    s = Sampler(SamplingParams(temperature=2.0, top_k=1, top_p=1.0, min_p=0.0))
    assert all(s(x) == int(np.argmax(x)) for _ in range(20))


def test_top_k_restricts_candidates():
    x = logits()
    top5 = set(np.argsort(-x)[:5].tolist())
    s = Sampler(SamplingParams(temperature=5.0, top_k=5, top_p=1.0, min_p=0.0, seed=1))
    assert {s(x) for _ in range(200)} <= top5


def test_top_p_and_min_p():
    x = np.full(10, -10.0, np.float32)
    x[3], x[5] = 5.0, 4.0   # two tokens hold almost all the mass
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0, seed=2))
    assert {s(x) for _ in range(200)} <= {3, 5}
    s = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.5, seed=2))
    assert {s(x) for _ in range(200)} == {3}  # p(5)/p(3) = e^-1 < 0.5


def test_penalties_change_the_greedy_choice():
    x = np.array([1.0, 0.9, 0.1], np.float32)
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=1.5))(x, [0]) == 1
    assert Sampler(SamplingParams(temperature=0, presence_penalty=0.2))(x, [0]) == 1
    assert Sampler(SamplingParams(temperature=0, frequency_penalty=0.06))(x, [0, 0]) == 1
    assert Sampler(SamplingParams(temperature=0, frequency_penalty=0.06))(x, [0]) == 0


def test_invalid_params():
    with pytest.raises(ValueError):
        Sampler(SamplingParams(temperature=-1))
    with pytest.raises(ValueError):
        Sampler(SamplingParams(top_p=1.5))


def test_subnormal_temperature_is_greedy_and_any_seed_works():
    x = logits()
    assert Sampler(SamplingParams(temperature=1e-310))(x) == int(np.argmax(x))
    assert Sampler(SamplingParams(temperature=1e-6, top_k=0, top_p=1.0, min_p=0.0))(x) == int(np.argmax(x))
    for seed in (-1, -(2 ** 70), 2 ** 70):
        a, b = Sampler(SamplingParams(temperature=1.0, seed=seed)), Sampler(SamplingParams(temperature=1.0, seed=seed))
        assert [a(x) for _ in range(10)] == [b(x) for _ in range(10)]
    for bad in (float("nan"), float("inf"), 1e9):
        with pytest.raises(ValueError):
            Sampler(SamplingParams(temperature=bad))


def constrain_case(rng, n=5, m=1000):
    """Random logits [n, m], masks for rows 1 and 3 (int32 [2, words], words past m included), and bias entries."""
    logits = rng.standard_normal((n, m)).astype(np.float32)
    rows = np.array([1, 3], np.int32)
    masks = rng.integers(-2 ** 31, 2 ** 31, (2, (m + 31) // 32 + 1), dtype=np.int64).astype(np.int32)
    bias = (np.array([0, 0, 3, 4], np.int32), np.array([7, 999, 7, 0], np.int32),
            np.array([-100.0, 5.5, 2.0, -1.0], np.float32))
    return logits, rows, masks, bias


def test_constrain_bias_then_masks():
    """Backend.constrain: the bias entries added, then each masked row -inf where its bit is clear; other rows and
    allowed tokens untouched."""
    from engine.backends.cpu import CPUBackend
    rng = np.random.default_rng()
    logits, rows, masks, bias = constrain_case(rng)
    want = logits.copy()
    for r, t, v in zip(*bias):
        want[r, t] += v
    for j, r in enumerate(rows):
        bits = (masks[j].view(np.uint32)[np.arange(1000) // 32] >> (np.arange(1000) % 32)) & 1
        want[r, bits == 0] = -np.inf
    got = CPUBackend().constrain(logits.copy(), rows, masks, bias)
    np.testing.assert_array_equal(got, want)
    assert np.isinf(got[rows]).any() and np.isfinite(got[[0, 2, 4]]).all()
