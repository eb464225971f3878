"""The scheduler on a tiny model: continuous batching, chunked prefill, queueing, cancellation."""
import numpy as np
import pytest

from conftest import run_requests
from engine.runtime import Runtime
from engine.sampling import SamplingParams
from engine.scheduler import FinishEvent, Request, Scheduler, TokenEvent, same_prompt
from tiny_models import N_VOCAB, write_tiny


@pytest.fixture(params=["paged", "whole-context"], autouse=True)
def kv_layout(request, monkeypatch):
    """Every test on both KV layouts: paged blocks, and one block of a whole context per sequence (a backend
    without block tables)."""
    from engine.backends.cpu import CPUBackend
    monkeypatch.setattr(CPUBackend, "paged_kv", request.param == "paged")
    return request.param


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("sched") / "llama.gguf", "llama")


def collect(events):
    return lambda ev: events.append(ev)


def test_batched_results_equal_single_runs(model):
    rng = np.random.default_rng()
    prompts = [rng.integers(0, N_VOCAB, n).tolist() for n in (5, 23, 9)]
    single = []
    for p in prompts:
        rt = Runtime.load(model, device="cpu", n_ctx=64)
        single.append(list(rt.generate(p, SamplingParams(temperature=0), 6, ignore_eos=True)))
    sched = Scheduler(Runtime.load(model, device="cpu", n_ctx=64, n_seq=3, n_ubatch=8))
    events = [[] for _ in prompts]
    for p, ev in zip(prompts, events):
        sched.submit(Request(p, SamplingParams(temperature=0), 6, ignore_eos=True), collect(ev))
    while sched.step():
        pass
    for ev, ref in zip(events, single):
        assert [e.token for e in ev if isinstance(e, TokenEvent)] == ref
        assert isinstance(ev[-1], FinishEvent) and ev[-1].reason == "length" and ev[-1].completion_tokens == 6


def test_long_prompt_prefills_in_chunks_beside_decoding(model):
    rng = np.random.default_rng()
    sched = Scheduler(Runtime.load(model, device="cpu", n_ctx=64, n_seq=2, n_ubatch=4))   # 4 tokens a step
    short, long_ = [], []
    sched.submit(Request(rng.integers(0, N_VOCAB, 3).tolist(), max_tokens=20, ignore_eos=True), collect(short))
    sched.step()                                    # the short prompt is in: its first token
    assert len(short) == 1
    sched.submit(Request(rng.integers(0, N_VOCAB, 17).tolist(), max_tokens=2, ignore_eos=True), collect(long_))
    for _ in range(5):                              # each step: one decode token + 3 prompt tokens
        sched.step()
    assert not long_ and sched.prefilling and sched.prefilling[0].prefilled == 15
    assert len([e for e in short if isinstance(e, TokenEvent)]) == 6   # it kept decoding, one token a step
    sched.step()                                    # the last 2 prompt tokens: the first token
    sched.step()                                    # then a decode step with the short one
    assert [type(e) for e in long_] == [TokenEvent, TokenEvent, FinishEvent] and not sched.prefilling
    assert len([e for e in short if isinstance(e, TokenEvent)]) == 8


def test_waiting_prompts_are_admitted_together(model):
    rng = np.random.default_rng()
    sched = Scheduler(Runtime.load(model, device="cpu", n_ctx=64, n_seq=4, n_ubatch=8), max_batch_tokens=16)
    events = [[] for _ in range(5)]
    for ev in events:
        sched.submit(Request(rng.integers(0, N_VOCAB, 4).tolist(), max_tokens=3, ignore_eos=True), collect(ev))
    sched.step()                                    # four slots, 16 tokens: four prompts in one forward
    assert [len(ev) for ev in events] == [1, 1, 1, 1, 0] and sched.queue_length == 1
    while sched.step():
        pass
    assert all(ev[-1].reason == "length" and ev[-1].completion_tokens == 3 for ev in events)


def test_queue_and_cancel(model):
    rng = np.random.default_rng()
    sched = Scheduler(Runtime.load(model, device="cpu", n_ctx=64, n_seq=1, n_ubatch=8))
    a, b, c = [], [], []
    ida = sched.submit(Request(rng.integers(0, N_VOCAB, 4).tolist(), max_tokens=50, ignore_eos=True), collect(a))
    sched.submit(Request(rng.integers(0, N_VOCAB, 4).tolist(), max_tokens=3, ignore_eos=True), collect(b))
    idc = sched.submit(Request(rng.integers(0, N_VOCAB, 4).tolist(), max_tokens=3, ignore_eos=True), collect(c))
    for _ in range(3):
        sched.step()
    assert sched.queue_length == 2 and not b and not c    # one KV slot: the others wait, in order
    sched.cancel(ida)
    sched.cancel(idc)
    while sched.step():
        pass
    assert a[-1].reason == "cancelled" and c == [FinishEvent("cancelled", 4, 0)]
    assert b[-1].reason == "length" and len(b) == 4
    assert sched.free_slots == [0] and not sched.running and sched.queue_length == 0


def test_same_prompt_shares_the_prefill(model):
    rng = np.random.default_rng()
    prompt = rng.integers(0, N_VOCAB, 13).tolist()
    ref = list(Runtime.load(model, device="cpu", n_ctx=64).generate(prompt, SamplingParams(temperature=0), 5,
                                                                    ignore_eos=True))
    sched = Scheduler(Runtime.load(model, device="cpu", n_ctx=64, n_seq=3, n_ubatch=8))
    events = [[], [], []]
    for ev in events:
        sched.submit(Request(prompt, SamplingParams(temperature=0), 5, ignore_eos=True), collect(ev))
    while sched.step():
        pass
    for ev in events:
        assert [e.token for e in ev if isinstance(e, TokenEvent)] == ref
    assert sched.stats.prompt_tokens_total == 13 and sched.stats.prompt_tokens_shared == 26


def test_no_request_stops_the_step_loop(model):
    """A subnormal temperature (1/T overflows), a negative seed sharing a running prompt, and a sequence whose
    event handler fails: each ends alone (or runs), and the others finish normally."""
    rng = np.random.default_rng()
    prompt = rng.integers(0, N_VOCAB, 6).tolist()
    sched = Scheduler(Runtime.load(model, device="cpu", n_ctx=64, n_seq=4, n_ubatch=8))
    tiny, shared, broken, plain = [], [], [], []

    def fails(ev):
        if isinstance(ev, TokenEvent):
            raise RuntimeError("handler failed")
        broken.append(ev)
    sched.submit(Request(prompt, SamplingParams(temperature=1e-310), 4, ignore_eos=True), collect(tiny))
    sched.submit(Request(prompt, SamplingParams(temperature=1.0, seed=-1), 4, ignore_eos=True), collect(shared))
    sched.submit(Request(rng.integers(0, N_VOCAB, 5).tolist(), max_tokens=4, ignore_eos=True), fails)
    sched.submit(Request(rng.integers(0, N_VOCAB, 5).tolist(), max_tokens=4, ignore_eos=True), collect(plain))
    while sched.step():
        pass
    for ev in (tiny, shared, plain):
        assert ev[-1].reason == "length" and ev[-1].completion_tokens == 4
    assert broken[-1].reason == "error" and "handler failed" in broken[-1].error
    assert sorted(sched.free_slots) == [0, 1, 2, 3] and not sched.running
    assert sched.stats.prompt_tokens_shared == 6


def greedy_tokens(events):
    return [e.token for e in events if isinstance(e, TokenEvent)]


def run_all(sched):
    while sched.step():
        pass


def test_prefix_cache_reuses_a_finished_requests_slot(model):
    """A second prompt sharing 40 tokens with a finished one prefills only the rest (the first token's event and the
    stats say so), and both sequences' greedy tokens equal a scheduler's without the cache; a multi-turn follow-up
    (the first prompt, its answer, a new turn) reuses everything but the answer's last token."""
    rng = np.random.default_rng()
    system = rng.integers(0, N_VOCAB, 40).tolist()
    q1, q2 = rng.integers(0, N_VOCAB // 2, 5).tolist(), rng.integers(N_VOCAB // 2, N_VOCAB, 6).tolist()   # part at 40
    outputs = {}
    for cache in (True, False):
        sched = Scheduler(Runtime.load(model, device="cpu", n_ctx=128, n_seq=2, n_ubatch=16), prefix_cache=cache)
        first, second, third = [], [], []
        sched.submit(Request(system + q1, SamplingParams(temperature=0), 5, ignore_eos=True), collect(first))
        run_all(sched)
        sched.submit(Request(system + q2, SamplingParams(temperature=0), 5, ignore_eos=True), collect(second))
        run_all(sched)
        follow_up = system + q1 + greedy_tokens(first) + q2
        sched.submit(Request(follow_up, SamplingParams(temperature=0), 5, ignore_eos=True), collect(third))
        run_all(sched)
        outputs[cache] = [greedy_tokens(ev) for ev in (first, second, third)]
        cached = [ev[0].cached_tokens for ev in (first, second, third)]
        assert cached == ([0, 40, 40 + 5 + 4] if cache else [0, 0, 0]), cached
        assert [ev[-1].cached_tokens for ev in (first, second, third)] == cached
        assert sched.stats.prefix_cache_hits == (2 if cache else 0)
        assert sched.stats.prompt_tokens_cached == (89 if cache else 0)
    assert outputs[True] == outputs[False]


def test_prefix_cache_shares_a_prefix_being_prefilled(model):
    """Four prompts with one 80-token system prefix, submitted together, 32 tokens a step: the first prefills it, the
    other three wait while at least MIN_COPY_PREFIX of its tokens are still to come (two steps), then copy the 64
    computed (computed once) and prefill the last 16 themselves rather than wait a step more; an unrelated request
    behind them is admitted at once; every sequence's greedy tokens equal its run alone."""
    rng = np.random.default_rng()
    system = rng.integers(0, N_VOCAB, 80).tolist()
    prompts = [system + [i] + rng.integers(0, N_VOCAB, 3 + i).tolist() for i in range(4)]   # they part at token 80
    other = rng.integers(0, N_VOCAB, 7).tolist()
    refs = [list(Runtime.load(model, device="cpu", n_ctx=128).generate(p, SamplingParams(temperature=0), 4,
                                                                       ignore_eos=True)) for p in prompts + [other]]
    sched = Scheduler(Runtime.load(model, device="cpu", n_ctx=128, n_seq=6, n_ubatch=32))
    events = [[] for _ in range(5)]
    for p, ev in zip(prompts + [other], events):
        sched.submit(Request(p, SamplingParams(temperature=0), 4, ignore_eos=True), collect(ev))
    for _ in range(2):
        sched.step()
        assert [s.req.prompt for s in sched.prefilling] == [prompts[0], other] and sched.queue_length == 3
    sched.step()
    assert sched.queue_length == 0
    run_all(sched)
    assert [greedy_tokens(ev) for ev in events] == refs
    assert sched.stats.prompt_tokens_cached == 3 * 64 and sched.stats.prefix_cache_hits == 3
    assert sched.stats.prompt_tokens_total == sum(len(p) for p in prompts + [other])


def test_a_cached_prefix_does_not_hold_a_burst(model):
    """Four prompts sharing a cached 40-token system prefix and two tokens past it, submitted together: none waits
    for another's prefill (two tokens are not worth a step), so all four have their first token after one step,
    each found the 40 cached tokens, and their greedy tokens equal their runs alone."""
    rng = np.random.default_rng()
    system = rng.integers(0, N_VOCAB, 40).tolist()
    prompts = [system + [7, 8] + rng.integers(0, N_VOCAB, 2 + i).tolist() for i in range(4)]   # they part at 42
    refs = [list(Runtime.load(model, device="cpu", n_ctx=128).generate(p, SamplingParams(temperature=0), 3,
                                                                       ignore_eos=True)) for p in prompts]
    sched = Scheduler(Runtime.load(model, device="cpu", n_ctx=128, n_seq=5, n_ubatch=32))
    run_requests(sched, [Request(system + [9], SamplingParams(temperature=0), 1)])      # the system prefix cached
    events = [[] for _ in prompts]
    for p, ev in zip(prompts, events):
        sched.submit(Request(p, SamplingParams(temperature=0), 3, ignore_eos=True), collect(ev))
    sched.step()
    assert all(len(ev) == 1 and ev[0].cached_tokens == 40 for ev in events), [ev[:1] for ev in events]
    run_all(sched)
    assert [greedy_tokens(ev) for ev in events] == refs


def test_logit_bias(model):
    """-100 on the greedy token changes it; +100 on another token forces it; the other sequence in the same steps
    (no bias, the backend's sampler) is unchanged."""
    rng = np.random.default_rng()
    prompt = rng.integers(0, N_VOCAB, 6).tolist()
    rt = Runtime.load(model, device="cpu", n_ctx=64, n_seq=3)
    plain = greedy_tokens(run_requests(Scheduler(rt), [Request(prompt, SamplingParams(temperature=0), 3,
                                                               ignore_eos=True)])[0])
    forced = int((plain[0] + 7) % N_VOCAB)
    banned, pushed, same = run_requests(Scheduler(rt), [
        Request(prompt, SamplingParams(temperature=0), 3, ignore_eos=True, logit_bias={plain[0]: -100.0}),
        Request(prompt, SamplingParams(temperature=0.8, seed=1), 3, ignore_eos=True, logit_bias={forced: 100.0}),
        Request(prompt, SamplingParams(temperature=0), 3, ignore_eos=True)])
    assert greedy_tokens(banned)[0] != plain[0] and greedy_tokens(pushed) == [forced] * 3
    assert greedy_tokens(same) == plain
    with pytest.raises(ValueError, match="logit_bias"):
        Scheduler(rt).submit(Request(prompt, max_tokens=2, logit_bias={N_VOCAB: 1.0}), lambda ev: None)


def test_prompt_token_ids_outside_the_vocabulary_are_refused(model):
    rt = Runtime.load(model, device="cpu", n_ctx=64, n_seq=1)
    sched = Scheduler(rt)
    for bad in ([N_VOCAB], [3, -1], [2 ** 70], [[1, 2]]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            sched.submit(Request([5] + bad, max_tokens=2), lambda ev: None)
    assert not sched.waiting
    sched.submit(Request([0, N_VOCAB - 1], max_tokens=2), lambda ev: None)      # both ends are ids
    assert len(sched.waiting) == 1 and sched.waiting[0].prompt_ids.tolist() == [0, N_VOCAB - 1]


def test_queue_time_is_reported(model):
    """With one KV slot, the second request waits for the first: its first token's event says how long."""
    rng = np.random.default_rng()
    sched = Scheduler(Runtime.load(model, device="cpu", n_ctx=64, n_seq=1))
    first, second = run_requests(sched, [Request(rng.integers(0, N_VOCAB, 5).tolist(), max_tokens=8,
                                                 ignore_eos=True) for _ in range(2)])
    assert first[0].queue_seconds < second[0].queue_seconds and second[0].queue_seconds > 0
    assert all(e.queue_seconds == 0 for e in second[1:] if isinstance(e, TokenEvent))


def test_same_prompt_is_list_equality():
    rng = np.random.default_rng()
    for _ in range(500):
        a = rng.integers(0, 3, int(rng.integers(0, 6))).tolist()
        b = a[:int(rng.integers(0, len(a) + 1))] + rng.integers(0, 3, int(rng.integers(0, 3))).tolist()
        assert same_prompt(a, b) == (a == b) and same_prompt(b, a) == (a == b) and same_prompt(a, list(a))


def test_prompt_logprobs_are_the_prefills(model):
    """Request.prompt_logprobs: each prompt token's log-prob after the ones before it and the k best there, as one
    prefill of the whole prompt gives them, though the prompt is prefilled in chunks beside another request's decode
    steps and an earlier request cached the same prompt (a scored prompt is computed whole); they come with the first
    token, or with max_tokens 0 with the end (float64 path: to 1e-9)."""
    rng = np.random.default_rng()
    prompt = rng.integers(0, N_VOCAB, 21).tolist()
    rt = Runtime.load(model, device="cpu", n_ctx=64, exact=True)             # float64: chunks round as the whole
    logits = rt.prefill(prompt, all_logits=True).astype(np.float64)          # [21, n_vocab]
    ref = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    sched = Scheduler(Runtime.load(model, device="cpu", n_ctx=64, n_seq=2, exact=True), max_batch_tokens=6)
    run_requests(sched, [Request(prompt, SamplingParams(temperature=0), 2, ignore_eos=True)])   # cached now
    other = Request(rng.integers(0, N_VOCAB, 5).tolist(), SamplingParams(temperature=0), 12, ignore_eos=True)
    for max_tokens in (3, 0):
        scored = Request(prompt, SamplingParams(temperature=0), max_tokens, ignore_eos=True, prompt_logprobs=2)
        _, events = run_requests(sched, [other, scored])
        end = events[-1]
        assert isinstance(end, FinishEvent) and end.cached_tokens == 0 and len(events) == max_tokens + 1
        assert [e.prompt_logprobs is not None for e in events] == [True] + [False] * max_tokens
        assert len(events[0].prompt_logprobs) == len(prompt) - 1
        for p, (lp, top) in enumerate(events[0].prompt_logprobs):
            assert lp == pytest.approx(ref[p, prompt[p + 1]], abs=1e-9)
            best = np.argsort(-ref[p], kind="stable")[:2]
            assert [t for t, _ in top] == best.tolist()
            assert [v for _, v in top] == pytest.approx(ref[p, best].tolist(), abs=1e-9)
    plain = run_requests(sched, [Request(prompt, SamplingParams(temperature=0), 1, ignore_eos=True)])[0]
    assert all(e.prompt_logprobs is None for e in plain)
