"""Batch invariance on the CPU backend (--batch-invariant): a greedy request's tokens and log-probs are bitwise the same
alone and beside other sequences that come and go at random steps, whatever chunks its prompt is cut into."""
import numpy as np
import pytest

from engine.backends import BackendError, get_backend
from engine.backends.cpu import CPUBackend
from engine.runtime import Runtime
from engine.sampling import SamplingParams
from engine.scheduler import FinishEvent, Request, Scheduler, TokenEvent
from tiny_models import N_VOCAB, write_tiny

N_CTX = 64
BUDGET = 24          # tokens a step: prompts go in chunks that depend on the decoding rows beside them
TOP = 4              # top log-probs asked for


@pytest.fixture(scope="module", params=["llama", "gemma3"])    # gemma3: a sliding window and a softcap-free GeGLU
def model(request, tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("inv") / f"{request.param}.gguf", request.param)


def target(prompt: list[int]) -> Request:
    return Request(prompt, SamplingParams(temperature=0), 8, ignore_eos=True, top_logprobs=TOP)


def run_schedule(rt: Runtime, schedule: list[tuple[int, Request]], budget: int = BUDGET) -> list[list]:
    """Submit each request at its step (schedule: (step, request)) to a new Scheduler on rt (budget tokens a step),
    step until every request ended -> each request's events."""
    sched = Scheduler(rt, budget)
    events = [[] for _ in schedule]
    step = 0
    while True:
        for (at, req), ev in zip(schedule, events):
            if at == step:
                sched.submit(req, ev.append)
        busy = sched.step()
        step += 1
        if not busy and step > max(at for at, _ in schedule):
            return events


def tokens_and_logprobs(events: list) -> list[tuple]:
    assert isinstance(events[-1], FinishEvent) and events[-1].reason == "length", events[-1]
    return [(e.token, e.logprob, e.top) for e in events if isinstance(e, TokenEvent)]


def alone_and_together(run, prompts: list[list[int]], others: int, n_vocab: int, max_len: int, rng) -> None:
    """Each prompt's greedy tokens and log-probs alone (run(schedule) -> events), then all of them arriving at random
    steps beside `others` random requests (random prompts, lengths, sampling and stops): asserts they are the same."""
    alone = [tokens_and_logprobs(run([(0, target(p))])[0]) for p in prompts]
    schedule = [(int(rng.integers(0, 12)), target(p)) for p in prompts]
    for _ in range(others):
        prompt = rng.integers(0, n_vocab, int(rng.integers(1, max_len))).tolist()
        sampling = SamplingParams(temperature=float(rng.choice([0.0, 0.9])), seed=int(rng.integers(1 << 30)))
        schedule.append((int(rng.integers(0, 24)), Request(prompt, sampling, int(rng.integers(1, 12)),
                                                           ignore_eos=True)))
    together = run(schedule)
    for i, ref in enumerate(alone):
        assert tokens_and_logprobs(together[i]) == ref, f"prompt {i} beside {others} others"



@pytest.mark.parametrize("others", [1, 7, 15, 31, 63])
def test_greedy_tokens_and_logprobs_do_not_depend_on_the_batch(model, others):
    rng = np.random.default_rng()
    prompts = [rng.integers(0, N_VOCAB, int(n)).tolist() for n in rng.integers(2, 40, 2)]

    def run(schedule):
        rt = Runtime.load(model, device="cpu", n_ctx=N_CTX, n_seq=len(schedule), batch_invariant=True)
        return run_schedule(rt, schedule)
    alone_and_together(run, prompts, others, N_VOCAB, 48, rng)


def test_a_prefix_from_the_cache_gives_the_same_tokens(model):
    """A prompt whose first blocks another request computed (prefix caching, on by default) gets the tokens and
    log-probs it gets alone."""
    rng = np.random.default_rng()
    prompt = rng.integers(0, N_VOCAB, 40).tolist()
    rt = Runtime.load(model, device="cpu", n_ctx=N_CTX, n_seq=4, batch_invariant=True)
    alone = tokens_and_logprobs(run_schedule(rt, [(0, target(prompt))])[0])
    sibling = prompt[:33] + rng.integers(0, N_VOCAB, 5).tolist()          # two full 16-position blocks in common
    events = run_schedule(rt, [(0, Request(sibling, SamplingParams(temperature=0), 12, ignore_eos=True)),
                                     (6, target(prompt))])
    assert events[1][-1].cached_tokens >= 32                        # the prefix did come from the cache
    assert tokens_and_logprobs(events[1]) == alone


def test_a_rows_product_is_the_same_in_any_company():
    rng = np.random.default_rng()
    B = CPUBackend(batch_invariant=True)
    w = rng.standard_normal((300, 256)).astype(np.float32)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    alone = B.mul_mat(w, x)
    for n in (2, 7, 16, 19, 53):
        company = rng.standard_normal((n, 256)).astype(np.float32)
        at = int(rng.integers(0, n))
        company[at] = x[0]
        y = B.mul_mat(w, company)
        assert y.shape == (n, 300)
        assert np.array_equal(y[at], alone[0])
        np.testing.assert_allclose(y, company @ w.T, rtol=1e-4, atol=1e-4)


def test_batch_invariance_is_refused_with_tensor_parallel(model):
    with pytest.raises(ValueError, match="batch-invariant.*tensor-parallel"):
        Runtime.load(model, device="cpu", n_ctx=N_CTX, tensor_parallel=2, batch_invariant=True)


def test_the_cuda_backend_refuses_forced_kernels_with_it():
    from engine.cuda.config import CudaConfig
    with pytest.raises(BackendError, match="batch-invariant.*decode-activations"):
        get_backend("cuda", batch_invariant=True, cuda=CudaConfig(exact_decode=True))


def test_the_cli_flag(model_path):
    import subprocess
    import sys
    from conftest import HAS_GPU
    cmd = [sys.executable, "-m", "engine.cli", "generate", model_path("smol"), "The capital of France is", "-n", "4",
           "--batch-invariant"]
    r = subprocess.run(cmd + ["--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    r = subprocess.run(cmd + ["--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in r.stderr, r.stderr
    assert (r.returncode == 0 and r.stdout.strip()) if HAS_GPU else (r.returncode != 0 and "GPU" in r.stderr), r.stderr
