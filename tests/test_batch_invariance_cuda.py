"""Batch invariance on the CUDA backend (--batch-invariant), GPU only: a column's products do not depend on the other
columns of the launch, and on the real models a greedy request's tokens and log-probs are bitwise the same alone and
beside 1-63 others that arrive at random steps (whatever chunks its prompt is cut into)."""
import numpy as np
import pytest

from engine.quants import GGMLType
from engine.runtime import Runtime
from test_batch_invariance import alone_and_together, run_schedule
from test_cuda_kernels import QTYPES, mmvq_activations_ref, nmse, random_weight, shapes

pytestmark = pytest.mark.gpu
COLUMNS = [1, 2, 3, 7, 8, 9, 16, 17, 64, 129, 512]
PROMPTS = 20            # prompts checked alone and together, per model and company size
MAX_PROMPT = 200
BUDGET = 64             # tokens a step


@pytest.fixture
def invariant():
    from engine.cuda.config import forced
    with forced(batch_invariant=True):
        yield


def _company(x: np.ndarray, n: int, rng) -> tuple[np.ndarray, int]:
    """n random rows with x's one row at a random place -> (rows, its place)."""
    rows = rng.standard_normal((n, x.shape[1])).astype(np.float32)
    at = int(rng.integers(0, n))
    rows[at] = x[0]
    return rows, at


@pytest.mark.parametrize("t", QTYPES, ids=lambda t: t.name)
def test_a_columns_products_do_not_depend_on_the_others(t, invariant):
    """mul_mat, the q/k/v launch and the fused GLU: a column's results bitwise the same at 1..512 columns."""
    import cupy as cp
    from engine.cuda import dispatch
    rng = np.random.default_rng()
    m, k = shapes(t)[0]
    (w, ref), (w2, _), (w3, _), (wu, _) = (random_weight(t, rows, k, rng) for rows in (m, m // 2 + 3, 37, m))
    x = rng.standard_normal((1, k)).astype(np.float32)
    alone = dispatch.mul_mat(w, cp.asarray(x)).get()[0]
    alone_qkv = [y.get()[0] for y in dispatch.mul_mats([w, w2, w3], cp.asarray(x))]
    alone_glu = dispatch.glu(w, wu, cp.asarray(x), "silu").get()[0]
    for n in COLUMNS:
        rows, at = _company(x, n, rng)
        xs = cp.asarray(rows)
        y = dispatch.mul_mat(w, xs).get()
        assert np.array_equal(y[at], alone), (t.name, n)
        assert nmse(y, mmvq_activations_ref(rows, t) @ ref.T) <= 1e-8, (t.name, n)
        for yi, ai in zip(dispatch.mul_mats([w, w2, w3], xs), alone_qkv):
            assert np.array_equal(yi.get()[at], ai), (t.name, n, "q/k/v")
        assert np.array_equal(dispatch.glu(w, wu, xs, "silu").get()[at], alone_glu), (t.name, n, "glu")


@pytest.mark.parametrize("t", [GGMLType.F16, GGMLType.F32], ids=lambda t: t.name)
def test_float_weights_columns_do_not_depend_on_the_others(t, invariant):
    import cupy as cp
    from engine.cuda import dispatch
    from engine.cuda.weights import upload
    rng = np.random.default_rng()
    m, k = 300, 1024
    ref = rng.standard_normal((m, k)).astype(np.float16 if t == GGMLType.F16 else np.float32)
    w = upload(t, (m, k), ref)
    x = rng.standard_normal((1, k)).astype(np.float32)
    alone = dispatch.mul_mat(w, cp.asarray(x)).get()[0]
    for n in COLUMNS:
        rows, at = _company(x, n, rng)
        y = dispatch.mul_mat(w, cp.asarray(rows)).get()
        assert np.array_equal(y[at], alone), (t.name, n)
        np.testing.assert_allclose(y, rows @ ref.T.astype(np.float32), rtol=1e-3, atol=1e-3)


@pytest.fixture(scope="module", params=["smol", "gemma"])
def runtime(request, model_path):
    from engine.cuda.config import configure, current
    before = current()
    rt = Runtime.load(model_path(request.param), device="cuda", n_ctx=512, n_seq=PROMPTS + 64,
                      batch_invariant=True)
    yield rt
    configure(before)


@pytest.mark.slow
@pytest.mark.parametrize("others", [1, 7, 15, 31, 63])
def test_real_models_greedy_does_not_depend_on_the_batch(runtime, others):
    rng = np.random.default_rng()
    n_vocab = runtime.config.n_vocab
    prompts = [rng.integers(0, n_vocab, int(n)).tolist() for n in rng.integers(2, MAX_PROMPT, PROMPTS)]
    alone_and_together(lambda schedule: run_schedule(runtime, schedule, BUDGET), prompts, others, n_vocab,
                       MAX_PROMPT, rng)


@pytest.mark.slow
def test_real_models_prefix_from_the_cache_gives_the_same_tokens(runtime):
    from engine.sampling import SamplingParams
    from engine.scheduler import Request
    from test_batch_invariance import target, tokens_and_logprobs
    rng = np.random.default_rng()
    n_vocab = runtime.config.n_vocab
    prompt = rng.integers(0, n_vocab, 150).tolist()
    alone = tokens_and_logprobs(run_schedule(runtime, [(0, target(prompt))], BUDGET)[0])
    sibling = prompt[:130] + rng.integers(0, n_vocab, 20).tolist()        # eight full 16-position blocks in common
    events = run_schedule(runtime, [(0, Request(sibling, SamplingParams(temperature=0), 16, ignore_eos=True)),
                                    (4, target(prompt))], BUDGET)
    assert events[1][-1].cached_tokens >= 128
    assert tokens_and_logprobs(events[1]) == alone
