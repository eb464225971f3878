"""The device sampler (kernels/sampling.cu) draws from the distribution engine/sampling.py defines."""
import math

import numpy as np
import pytest

from engine.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.gpu
DRAWS = 10_000


def chi2_critical(dof: int, z: float = 3.719) -> float:
    """Wilson-Hilferty: the chi-square quantile at the normal quantile z (3.719: p = 1e-4)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def draws(logits: np.ndarray, params: SamplingParams, history=None, n=DRAWS, seed=None) -> np.ndarray:
    """n device draws from one row of logits (n rows, each its own seed)."""
    import cupy as cp
    from engine.cuda.sampling import sample
    samplers = []
    for i in range(n):
        s = Sampler(SamplingParams(**{**params.__dict__, "seed": None if seed is None else seed + i}))
        samplers.append(s)
    x = cp.asarray(np.broadcast_to(logits, (n, len(logits))).astype(np.float32))
    return sample(x, samplers, [history or []] * n)


PARAMS = [
    SamplingParams(temperature=0.8, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=1.5, top_k=7, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.05),
    SamplingParams(temperature=1.2, top_k=0, top_p=1.0, min_p=0.1),
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.2),
]


@pytest.mark.parametrize("params", PARAMS, ids=range(len(PARAMS)))
@pytest.mark.parametrize("n_vocab", [300, 50_000])
def test_device_draws_match_the_reference_distribution(params, n_vocab):
    rng = np.random.default_rng()
    logits = (rng.standard_normal(n_vocab) * 2.5).astype(np.float32)
    logits[rng.integers(0, n_vocab, 12)] += 6.0                      # a head of likely tokens, a long tail
    history = rng.integers(0, n_vocab, 40).tolist() + list(np.argsort(-logits)[:3])
    cand, probs = Sampler(params).distribution(logits, history)
    got = draws(logits, params, history)
    expected = np.zeros(n_vocab)
    expected[cand] = probs * DRAWS
    assert np.all(expected[got] > 0), "a token outside the reference's candidates was drawn"
    observed = np.bincount(got, minlength=n_vocab)
    big = expected >= 5
    cells_obs = np.append(observed[big], observed[~big].sum())
    cells_exp = np.append(expected[big], expected[~big].sum())
    keep = cells_exp > 0
    stat = float(np.sum((cells_obs[keep] - cells_exp[keep]) ** 2 / cells_exp[keep]))
    dof = int(keep.sum()) - 1
    if dof == 0:                         # one candidate holds all the mass (min_p / top_k left one token): every draw
        assert np.all(got == np.argmax(expected)), "another token than the only candidate was drawn"
        return
    assert stat < chi2_critical(dof), (stat, dof)


def test_greedy_and_seeds():
    import cupy as cp
    from engine.cuda.sampling import sample
    rng = np.random.default_rng()
    x = rng.standard_normal((5, 1000)).astype(np.float32)
    x[2, 7] = x[2, 9] = x[2].max() + 1                               # a tie: the first index, as numpy
    greedy = [Sampler(SamplingParams(temperature=0)) for _ in range(5)]
    assert sample(cp.asarray(x), greedy, [[]] * 5).tolist() == np.argmax(x, axis=1).tolist()
    p = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    alone = sample(cp.asarray(x[3:4]), [Sampler(p)], [[]])[0]
    others = [Sampler(SamplingParams(temperature=1.0, seed=i)) for i in range(4)]
    mixed = sample(cp.asarray(x[[0, 1, 3, 4, 2]]), others[:2] + [Sampler(p)] + others[2:], [[]] * 5)
    assert mixed[2] == alone                                           # a seed's draw ignores its batch
    s = Sampler(p)
    a = [int(sample(cp.asarray(x[3:4]), [s], [[]])[0]) for _ in range(20)]
    s = Sampler(p)
    assert a == [int(sample(cp.asarray(x[3:4]), [s], [[]])[0]) for _ in range(20)] and len(set(a)) > 1


def test_constrain_on_the_device_equals_the_cpu():
    """CUDABackend.constrain (kernels add_bias, constrain_rows) gives the CPU backend's logits, bit for bit."""
    import cupy as cp
    from engine.backends.cpu import CPUBackend
    from engine.backends.cuda import CUDABackend
    from test_sampling import constrain_case
    rng = np.random.default_rng()
    logits, rows, masks, bias = constrain_case(rng, n=6, m=4099)
    want = CPUBackend().constrain(logits.copy(), rows, masks, bias)
    got = CUDABackend().constrain(cp.asarray(logits), rows, masks, bias).get()
    np.testing.assert_array_equal(got, want)
