"""The paged KV cache: the block manager, attention through block tables, admission by free blocks, preemption,
prefix caching across requests."""
import numpy as np
import pytest

from engine.kv_blocks import ROOT, BlockManager, TableRows, block_key
from engine.runtime import Runtime
from engine.sampling import SamplingParams
from engine.scheduler import FinishEvent, Request, Scheduler, TokenEvent
from conftest import run_requests
from tiny_models import N_VOCAB, write_tiny


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("kv") / "llama.gguf", "llama")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("kv") / "gemma3.gguf", "gemma3")   # a 16-token sliding window


def tokens_of(events):
    return [e.token for e in events if isinstance(e, TokenEvent)]


def alone(model, prompt, n, **kw):
    rt = Runtime.load(model, device="cpu", n_ctx=kw.pop("n_ctx", 128))
    request = Request(prompt, SamplingParams(temperature=0), n, ignore_eos=True)
    return tokens_of(run_requests(Scheduler(rt), [request])[0])


# -- the block manager ---------------------------------------------------------------------------------------------
def test_blocks_are_reused_least_recently_released_first_and_forget_when_evicted():
    m = BlockManager(3, 4)
    a, b, c = m.allocate(), m.allocate(), m.allocate()
    assert (a, b, c) == (0, 1, 2) and m.n_free == 0
    ka = m.write(a, ROOT, 0, [1, 2, 3, 4])
    m.write(b, ka, 0, [5, 6])
    m.release(b)
    m.release(a)                                    # a is the most recent: b goes first
    assert m.n_free == 2 and m.next_free() == b
    assert m.match(np.array([1, 2, 3, 4, 5, 6, 7]), 7) == ([a], b, 2)
    assert m.allocate() == b and m.match(np.array([1, 2, 3, 4, 5, 6, 7]), 7) == ([a], -1, 0)   # b's tokens gone
    m.hold(a)                                       # shared again: out of the free list
    assert m.n_free == 0 and m.ref[a] == 1


def test_match_walks_full_blocks_by_digest_and_respects_the_limit():
    m = BlockManager(4, 2)
    t = np.array([7, 8, 9, 10, 11])
    b0, b1, b2 = m.allocate(), m.allocate(), m.allocate()
    k0 = m.write(b0, ROOT, 0, t[:2])
    k1 = m.write(b1, k0, 0, t[2:4])
    m.write(b2, k1, 0, t[4:5])
    assert k1 == block_key(block_key(ROOT, t[:2]), t[2:4])
    assert m.match(t, 5) == ([b0, b1], b2, 1)
    assert m.match(t, 4) == ([b0, b1], -1, 0)       # the limit stops before the partial block
    assert m.match(t, 3) == ([b0], b1, 1)           # a full block matched in part
    assert m.match(np.array([7, 0, 9]), 3) == ([], b0, 1)
    assert m.match(np.array([10, 11]), 2) == ([], -1, 0)      # the same tokens after another prefix: no match


def test_match_takes_the_child_holding_the_longest_prefix():
    """Many blocks after one shared prefix (a system prompt's followers), holding random tokens of random lengths,
    some shortened over what they held before (stale tokens past their length): match picks, of the children holding
    the most of the next tokens, the first in the children's order, as a scan one by one would; at any limit."""
    from engine.kv_blocks import common_prefix
    rng = np.random.default_rng()
    m = BlockManager(400, 8)
    shared = rng.integers(0, 4, 8)
    root = m.allocate()
    key = m.write(root, ROOT, 0, shared)
    for _ in range(300):
        b = m.allocate()
        m.write(b, key, 0, rng.integers(0, 4, 8))            # tokens from 4 values: long common prefixes happen
        m.truncate(b, int(rng.integers(1, 9)))
        m.release(b)
    for _ in range(200):
        t = np.concatenate([shared, rng.integers(0, 4, int(rng.integers(1, 12)))])
        limit = int(rng.integers(9, len(t) + 1))
        best, best_n = -1, 0
        for c in m.children[key]:
            n = common_prefix(m.ids[c, :m.length[c]], t[8:], limit - 8)
            if n > best_n:
                best, best_n = c, n
        assert m.match(t, limit) == ([root], best, best_n)
    assert m.match(t, len(t) + 5) == m.match(t, len(t))          # a limit past the tokens: all of them


def test_match_reusing_the_last_walk_finds_what_a_fresh_manager_finds():
    """match() reuses the digests of the blocks a prompt shares with the one walked before it, and the blocks found for
    them: over prompts that share random prefixes with earlier ones (cut anywhere, inside a block too) and with the
    cache, while blocks are written, released, evicted and written over between the matches, every answer and every
    digest is what digesting each prompt from scratch gives."""
    rng = np.random.default_rng()
    size = 4
    m = BlockManager(200, size)
    base = rng.integers(0, 3, 60)
    parent, held = ROOT, []                               # the cache holds base's first 10 full blocks
    for j in range(10):
        b = m.allocate()
        parent = m.write(b, parent, 0, base[j * size:(j + 1) * size])
        held.append(b)
    prompts = [base]
    for _ in range(600):
        src = prompts[int(rng.integers(len(prompts)))]
        cut = int(rng.integers(0, len(src) + 1))
        t = np.concatenate([src[:cut], rng.integers(0, 3, int(rng.integers(0, 20)))])
        limit = int(rng.integers(0, len(t) + 1))
        fresh, key, i = [], ROOT, 0
        while i + size <= limit:
            key = block_key(key, t[i:i + size])
            b = m.full.get(key)
            if b is None:
                break
            fresh.append(b)
            i += size
        assert m.match(t, limit)[0] == fresh, (cut, limit)
        walked, keys, _, _ = m._walked
        for j, k in enumerate(keys):                      # the kept digests are those of the walked tokens
            assert k == (block_key(keys[j - 1] if j else ROOT, walked[j * size:(j + 1) * size]))
        prompts.append(t)
        churn = rng.integers(4)                           # the index changes between matches
        if churn == 0 and len(t) >= size and m.n_free >= 6:    # a prompt's blocks written (new keys)
            parent = ROOT
            for j in range(min(len(t) // size, 6)):
                b = m.allocate()                          # (evicting a cached block: its key goes)
                parent = m.write(b, parent, 0, t[j * size:(j + 1) * size])
                held.append(b)
        elif churn == 1 and held:                         # a block released (stays cached, findable)
            m.release(held.pop(int(rng.integers(len(held)))))
        elif churn == 2 and held:                         # a held full block written over: its key goes
            b = held[int(rng.integers(len(held)))]
            m.write(b, m.parent[b], int(rng.integers(size)), rng.integers(0, 3, 1))


def test_match_does_not_reuse_a_block_whose_key_left_the_index():
    """A block found by the last walk and written over since (or evicted) is not found again for the same prefix."""
    m = BlockManager(8, 2)
    t = np.array([1, 2, 3, 4, 5, 6, 7], np.int32)
    parent, blocks = ROOT, []
    for j in range(3):
        b = m.allocate()
        parent = m.write(b, parent, 0, t[2 * j:2 * j + 2])
        blocks.append(b)
    assert m.match(t, 7)[0] == blocks
    m.write(blocks[1], m.parent[blocks[1]], 1, [9])             # block 1 written over: its key goes, the walk stops
    assert m.match(t, 7)[0] == blocks[:1]
    m.release(blocks[0])
    for _ in range(8 - 3):
        m.allocate()                                              # the empty blocks first ...
    m.allocate()                                                  # ... then the cached block 0, evicted
    assert m.match(t, 7)[0] == []


def test_hold_all_equals_hold_one_by_one():
    a, b = BlockManager(8, 2), BlockManager(8, 2)
    for m in (a, b):
        x, y, z = m.allocate(), m.allocate(), m.allocate()
        k = m.write(x, ROOT, 0, [1, 2])
        m.write(y, k, 0, [3, 4])
        m.release(x)                                      # x cached, y held, z held
        m.release(z)
    a.hold_all([0, 1, 2])
    for blk in (0, 1, 2):
        b.hold(blk)
    assert np.array_equal(a.ref, b.ref) and list(a.cached) == list(b.cached) and list(a.empty) == list(b.empty)


@pytest.mark.parametrize("kv_type", [None, "q8_0"])
def test_copy_prefix_copies_every_layer_and_only_the_prefix(kv_type):
    """A block's first n positions go to another block in every layer's keys, values (and q8_0 scales); nothing
    else moves. The layers are views of one array each (one copy for all of them)."""
    from engine.backends.cpu import CPUBackend
    cache = CPUBackend().kv_cache(3, 4, 8, 2, 32, **({"kv_type": kv_type} if kv_type else {}))
    rng = np.random.default_rng()
    arrays = [cache.k, cache.v] + ([cache.k_scale, cache.v_scale] if kv_type else [])
    for layers in arrays:
        for a in layers:
            a[...] = rng.integers(-100, 100, a.shape).astype(a.dtype)
    before = [[a.copy() for a in layers] for layers in arrays]
    cache.copy_prefix(1, 3, 5)
    for layers, old in zip(arrays, before):
        for a, b in zip(layers, old):
            assert np.array_equal(a[3, :5], b[1, :5]) and np.array_equal(a[3, 5:], b[3, 5:])
            assert np.array_equal(a[:3], b[:3])
    assert all(np.shares_memory(a, cache.k_layers) for a in cache.k)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("per_layer", [False, True])
def test_copy_prefix_on_the_gpu_as_memory_copies(kv_type, per_layer, monkeypatch):
    """The GPU cache's copy_prefix (cudaMemcpy2DAsync over the layers, or a copy per layer where the layers lie
    further apart than a 2D copy's pitch) moves a block's first n positions in every layer and nothing else."""
    import cupy as cp
    from engine.backends import cuda as cuda_backend
    if per_layer:
        monkeypatch.setattr(cuda_backend, "_max_pitch", lambda device: 0)
    cache = cuda_backend.CUDABackend().kv_cache(5, 6, 16, 2, 64, kv_type=kv_type)
    rng = np.random.default_rng()
    for a in (cache.k_layers, cache.v_layers):
        a[...] = cp.asarray(rng.integers(0, 256, a.shape), a.dtype) if a.dtype == cp.uint8 else \
            cp.asarray(rng.standard_normal(a.shape), a.dtype)
    before = [a.get() for a in (cache.k_layers, cache.v_layers)]
    cache.copy_prefix(4, 1, 9)
    for a, old in zip((cache.k_layers, cache.v_layers), before):
        want = old.copy()
        want[:, 1, :9] = old[:, 4, :9]
        assert np.array_equal(a.get(), want)


@pytest.mark.gpu
def test_copy_prefix_on_the_gpu_across_a_cache_of_over_4_gib():
    """The GPU's cache at the synthetic 8B's serving size (32 layers of 4,609 blocks: 4.8 GB for the keys), so a
    copy across layers spans offsets past 2**31 bytes: every layer's block gets the prefix, nothing else moves."""
    import cupy as cp
    from engine.backends.cuda import CUDABackend
    cache = CUDABackend().kv_cache(32, 4608, 16, 8, 128)
    rng = np.random.default_rng()
    src, dst, n = 4600, 7, 11
    for layers in (cache.k, cache.v):
        for a in layers:
            a[src] = cp.asarray(rng.standard_normal(a[src].shape), a.dtype)
            a[dst] = cp.asarray(rng.standard_normal(a[dst].shape), a.dtype)
    before = [[(a[src].get(), a[dst].get(), a[dst + 1].get()) for a in layers] for layers in (cache.k, cache.v)]
    cache.copy_prefix(src, dst, n)
    for layers, old in zip((cache.k, cache.v), before):
        for a, (s_old, d_old, next_old) in zip(layers, old):
            d = a[dst].get()
            assert np.array_equal(d[:n], s_old[:n]) and np.array_equal(d[n:], d_old[n:])
            assert np.array_equal(a[src].get(), s_old) and np.array_equal(a[dst + 1].get(), next_old)
    del cache
    cp.get_default_memory_pool().free_all_blocks()


def test_without_caching_a_released_block_forgets():
    m = BlockManager(2, 2, caching=False)
    b = m.allocate()
    m.write(b, ROOT, 0, [1, 2])
    m.release(b)
    assert m.match(np.array([1, 2, 3]), 3) == ([], -1, 0) and m.n_free == 2


# -- attention through block tables --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_scattered_blocks_equal_contiguous_ones(model, gemma, arch):
    """The same prompt and decode steps through a shuffled block table give the logits of the static one."""
    path = model if arch == "llama" else gemma
    rng = np.random.default_rng()
    prompt = rng.integers(0, N_VOCAB, 45).tolist()
    out = []
    for tables in (None, {0: rng.permutation(8)[:4].tolist()}):
        rt = Runtime.load(path, device="cpu", n_ctx=64, n_seq=2)
        assert rt.block_size < rt.n_ctx and rt.n_blocks == 8
        first = rt.forward(prompt, list(range(45)), [0] * 45, list(range(45)), tables)
        step = rt.forward([3], [45], [0], [0], tables)
        out.append(np.concatenate([first, step]))
    np.testing.assert_allclose(out[0], out[1], rtol=0, atol=1e-6)


# -- the scheduler on blocks ---------------------------------------------------------------------------------------
def kv_bytes(rt, positions):
    return positions * rt.model.kv_bytes_per_token()


def test_more_sequences_than_whole_contexts_fit(model):
    """In the KV memory of 2 whole 128-token contexts, 8 sequences of ~30 tokens run at once (slots, not memory,
    the limit), with 0 errors and each one's greedy tokens equal to its run alone."""
    rng = np.random.default_rng()
    prompts = [rng.integers(0, N_VOCAB, int(n)).tolist() for n in rng.integers(10, 20, 8)]
    probe = Runtime.load(model, device="cpu", n_ctx=128)
    rt = Runtime.load(model, device="cpu", n_ctx=128, n_seq=8, kv_memory=kv_bytes(probe, 2 * 128))
    assert rt.n_blocks == 2 * 128 // rt.block_size
    sched = Scheduler(rt, 64)
    reqs = [Request(p, SamplingParams(temperature=0), 12, ignore_eos=True) for p in prompts]
    events = [[] for _ in reqs]
    for r, ev in zip(reqs, events):
        sched.submit(r, ev.append)
    sched.step()
    assert len(sched.prefilling) + len(sched.running) == 8          # all admitted in one step
    while sched.step():
        pass
    assert all(isinstance(ev[-1], FinishEvent) and ev[-1].reason == "length" for ev in events)
    assert [tokens_of(ev) for ev in events] == [alone(model, p, 12) for p in prompts]
    assert sched.stats.preemptions == 0 and sched.blocks.n_free == rt.n_blocks


def test_preempted_sequences_resume_with_the_same_tokens(model):
    """Six sequences that outgrow the memory: the last admitted are preempted, recomputed from their cache and go on
    where they were; greedy and seeded sampled tokens equal those of a run with room for all, and every block is
    free at the end."""
    rng = np.random.default_rng()
    prompts = [rng.integers(0, N_VOCAB, 20).tolist() for _ in range(6)]
    params = [SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=0.9, seed=i)
              for i in range(6)]
    results = []
    for positions in (6 * 128, 160):                # float64: recomputing cannot tip a near tie
        probe = Runtime.load(model, device="cpu", n_ctx=128, exact=True)
        rt = Runtime.load(model, device="cpu", n_ctx=128, n_seq=6, exact=True, kv_memory=kv_bytes(probe, positions))
        sched = Scheduler(rt, 32)
        events = run_requests(sched, [Request(p, sp, 40, ignore_eos=True) for p, sp in zip(prompts, params)])
        assert all(ev[-1].reason == "length" and ev[-1].completion_tokens == 40 for ev in events)
        results.append(([tokens_of(ev) for ev in events], sched.stats.preemptions))
        assert sched.blocks.n_free == rt.n_blocks and sorted(sched.free_slots) == list(range(6))
    (roomy, none), (tight, some) = results
    assert none == 0 and some > 0
    assert tight == roomy


def test_a_request_waits_for_blocks_in_order(model):
    """With blocks for one prompt at a time, the second request waits (FIFO) until the first frees its blocks."""
    rng = np.random.default_rng()
    probe = Runtime.load(model, device="cpu", n_ctx=64)
    rt = Runtime.load(model, device="cpu", n_ctx=64, n_seq=3, kv_memory=kv_bytes(probe, 64))
    sched = Scheduler(rt, 64, prefix_cache=False)
    first, second = [], []
    sched.submit(Request(rng.integers(0, N_VOCAB, 50).tolist(), max_tokens=4, ignore_eos=True), first.append)
    sched.submit(Request(rng.integers(0, N_VOCAB, 40).tolist(), max_tokens=4, ignore_eos=True), second.append)
    sched.step()
    assert len(sched.running) == 1 and sched.queue_length == 1
    while sched.step():
        pass
    assert first[-1].reason == second[-1].reason == "length"


def test_a_prompt_filling_the_whole_cache_is_admitted(model):
    """A cache of exactly one context (100 blocks: a watermark of one) still takes a prompt that needs all of it."""
    probe = Runtime.load(model, device="cpu", n_ctx=1600)
    rt = Runtime.load(model, device="cpu", n_ctx=1600, kv_memory=kv_bytes(probe, 1600))
    assert rt.n_blocks == 100 and Scheduler(rt).watermark == 1
    prompt = np.random.default_rng().integers(0, N_VOCAB, 1590).tolist()
    events = run_requests(Scheduler(rt, 512), [Request(prompt, max_tokens=5, ignore_eos=True)])[0]
    assert events[-1].reason == "length" and events[-1].completion_tokens == 5


def test_shared_system_prompt_is_computed_once(model):
    """32 requests with one 200-token system prompt and 20-token questions, 8 at a time: the prompt's full blocks are
    prefilled once and shared by the rest (stats, usage), and the greedy tokens equal those with the cache off."""
    rng = np.random.default_rng()
    system = rng.integers(0, N_VOCAB, 200).tolist()
    prompts = [system + [i] + rng.integers(0, N_VOCAB, 19).tolist() for i in range(32)]   # they part at token 200
    out = {}
    for cache in (True, False):
        rt = Runtime.load(model, device="cpu", n_ctx=256, n_seq=8)
        sched = Scheduler(rt, 256, prefix_cache=cache)
        events = run_requests(sched, [Request(p, SamplingParams(temperature=0), 4, ignore_eos=True) for p in prompts])
        out[cache] = [tokens_of(ev) for ev in events]
        cached = [ev[0].cached_tokens for ev in events]
        if cache:                                   # full blocks shared, the partial one's 200 % 16 tokens copied
            assert cached == [0] + [200] * 31 and sched.stats.prefix_cache_hits == 31
            assert sched.stats.prompt_tokens_total - sched.stats.prompt_tokens_cached == 200 + 32 * 20
        else:
            assert cached == [0] * 32 and sched.stats.prompt_tokens_cached == 0
    assert out[True] == out[False]


def test_kv_memory_errors(model, monkeypatch):
    probe = Runtime.load(model, device="cpu", n_ctx=128)
    with pytest.raises(ValueError, match="fewer than one sequence's context of 128"):
        Runtime.load(model, device="cpu", n_ctx=128, kv_memory=kv_bytes(probe, 100))
    from engine.backends.cpu import CPUBackend
    monkeypatch.setattr(CPUBackend, "paged_kv", False)
    rt = Runtime.load(model, device="cpu", n_ctx=128, n_seq=3)
    assert (rt.block_size, rt.n_blocks) == (128, 3)               # one whole-context block per sequence
    with pytest.raises(ValueError, match="one contiguous KV cache per sequence"):
        Runtime.load(model, device="cpu", n_ctx=128, kv_memory=kv_bytes(probe, 1024))


def test_whole_context_blocks_keep_prefix_caching(model, monkeypatch):
    """A backend without block tables: one block per sequence, a finished
    request's block taken over or copied by the next prompt sharing its prefix, tokens unchanged."""
    from engine.backends.cpu import CPUBackend
    monkeypatch.setattr(CPUBackend, "paged_kv", False)
    rng = np.random.default_rng()
    system = rng.integers(0, N_VOCAB, 40).tolist()
    firsts = rng.choice(N_VOCAB, 3, replace=False)         # they part at token 40 (a random one matched 1 in 320)
    prompts = [system + [int(f)] + rng.integers(0, N_VOCAB, 4).tolist() for f in firsts]
    rt = Runtime.load(model, device="cpu", n_ctx=128, n_seq=2)
    sched = Scheduler(rt, 64)
    events = [run_requests(sched, [Request(p, SamplingParams(temperature=0), 4, ignore_eos=True)])[0] for p in prompts]
    assert [ev[0].cached_tokens for ev in events] == [0, 40, 40]
    monkeypatch.undo()
    assert [tokens_of(ev) for ev in events] == [alone(model, p, 4) for p in prompts]


# -- the cache's type ----------------------------------------------------------------------------------------------
def test_q8_0_quantizer_equals_gguf():
    """The q8_0 KV cache rounds as GGML's q8_0 blocks do (the gguf package's quantizer), bit for bit."""
    from gguf import GGMLQuantizationType as GT
    from gguf import quants as gq

    from engine.backends.cpu import dequantize_q8_0, quantize_q8_0
    rng = np.random.default_rng()
    x = (rng.standard_normal((9, 128)) * rng.uniform(0.01, 20, (9, 1))).astype(np.float32)
    x[0, :32] = 0                                            # a block of zeros: scale 0
    x[1, :32] = 127 * 0.5 / 127 * np.sign(rng.standard_normal(32))   # exact halves: rounding away from zero
    blocks = gq.quantize(x, GT.Q8_0).reshape(9, 4, 34)
    q, scale = quantize_q8_0(x)
    assert np.array_equal(q.reshape(9, 4, 32), blocks[..., 2:].view(np.int8))
    assert np.array_equal(scale.view(np.uint16), blocks[..., :2].copy().view(np.uint16)[..., 0])
    back = dequantize_q8_0(q, scale, np.float32)
    # per block: half a step of the f32 scale, plus 127 steps of the scale's f16 rounding
    exact = np.abs(x.reshape(9, 4, 32)).max(axis=-1) / np.float32(127)
    bound = exact / 2 + 127 * np.abs(scale.astype(np.float32) - exact)
    err = np.abs(back - x).reshape(9, 4, 32).max(axis=-1)
    assert (err <= bound * (1 + 1e-5) + 1e-6).all()


def kl(p_logits, q_logits):
    lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    return float((np.exp(lp) * (lp - lq)).sum(axis=-1).mean())


def forced(path, tokens, n_prefill, kv_type, n_ctx=128, device="cpu"):
    """Logits of tokens teacher-forced: the first n_prefill in one prefill, the rest one decode step each."""
    rt = Runtime.load(path, device=device, n_ctx=n_ctx, kv_type=kv_type)
    first = rt.prefill(tokens[:n_prefill], all_logits=True)
    steps = [rt.decode([0], [t], [n_prefill + i]) for i, t in enumerate(tokens[n_prefill:])]
    return np.concatenate([first, *steps])


def test_smaller_kv_types_cost_fidelity_in_order_and_hold_more(model):
    """On the tiny model, teacher-forced through a prefill and decode steps: an f16 cache is nearer the f32 one than
    a q8_0 cache is, neither equals it; the same KV memory holds 2x / 3.8x the blocks."""
    tokens = np.random.default_rng().integers(0, N_VOCAB, 68).tolist()
    f32, f16, q8 = (forced(model, tokens, 60, t) for t in (None, "f16", "q8_0"))
    assert 0 < kl(f32, f16) < kl(f32, q8) < 0.5
    probe = Runtime.load(model, device="cpu", n_ctx=128)
    memory = kv_bytes(probe, 1024)
    for kv_type, per_value in (("f16", 2), ("q8_0", 34 / 32)):
        small = Runtime.load(model, device="cpu", n_ctx=128, kv_type=kv_type, kv_memory=memory)
        assert small.n_blocks == int(memory // (small.block_size * small.model.kv_bytes_per_token(kv_type)))
        assert small.n_blocks / (1024 // small.block_size) == pytest.approx(4 / per_value, rel=0.05)


@pytest.mark.slow
@pytest.mark.parametrize("key, name", [("smol", "smollm2-135m"), ("gemma", "gemma3-270m")])
def test_smaller_kv_types_on_the_real_models(model_path, key, name):
    """The first 300 tokens of the Apache text, teacher-forced (256 prefilled, 44 decode steps): KL to the f32 cache
    at most 1e-4 with f16 and 5e-3 with q8_0 (over the whole text against the exact path: 1e-5 and 0.0014 on
    SmolLM2; BENCHMARKS.md)."""
    from conftest import GOLDEN
    model_path(key)
    tokens = [int(t) for t in (GOLDEN / f"apache.{key}.tokens").read_text().split()][:300]
    f32, f16, q8 = (forced(name, tokens, 256, t, n_ctx=512) for t in (None, "f16", "q8_0"))
    assert kl(f32, f16) <= 1e-4 and kl(f32, q8) <= 5e-3


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("key, name", [("smol", "smollm2-135m"), ("gemma", "gemma3-270m")])
def test_q8_0_kv_cache_on_the_gpu(model_path, key, name):
    """The GPU's q8_0 cache, teacher-forced as above (its prefill through the SIMT kernels, its decode steps
    replayed from CUDA graphs): within the CPU's bound of the GPU's own f16 cache, and not equal to it; it holds 2x
    the f16 cache's positions in the same memory."""
    from conftest import GOLDEN
    model_path(key)
    tokens = [int(t) for t in (GOLDEN / f"apache.{key}.tokens").read_text().split()][:300]
    f16, q8 = (forced(name, tokens, 256, t, n_ctx=512, device="cuda") for t in (None, "q8_0"))
    assert 0 < kl(f16, q8) <= 5e-3
    f16_rt = Runtime.load(name, device="cuda", n_ctx=512)
    q8_rt = Runtime.load(name, device="cuda", n_ctx=512, kv_type="q8_0", kv_memory=kv_bytes(f16_rt, 1024))
    assert q8_rt.n_blocks / (1024 // q8_rt.block_size) == pytest.approx(2 / (34 / 32), rel=0.05)


def test_kv_type_the_backend_does_not_offer(model, monkeypatch):
    from engine.backends.cpu import CPUBackend
    monkeypatch.setattr(CPUBackend, "kv_types", ())
    with pytest.raises(ValueError, match="cannot be q8_0"):
        Runtime.load(model, device="cpu", n_ctx=64, kv_type="q8_0")


def test_kv_f32_and_kv_type_together_is_an_error(model):
    with pytest.raises(ValueError, match="--kv-f32 and --kv-type q8_0 both name the KV cache's type"):
        Runtime.load(model, device="cpu", n_ctx=64, kv_type="q8_0", kv_f32=True)
    from test_runtime_cpu import run_cli
    for command in ("generate", "bench", "serve"):         # the CLI refuses them before loading anything
        r = run_cli(command, model, *(["hi"] if command == "generate" else []), "--kv-f32", "--kv-type", "q8_0",
                    timeout=60)
        assert r.returncode == 2 and "--kv-type: not allowed with argument --kv-f32" in r.stderr, (command, r.stderr)


def test_q8_0_cache_needs_whole_blocks_of_32():
    from engine.backends.cpu import CPUBackend
    with pytest.raises(ValueError, match="multiple of 32 .this model's is 48."):
        CPUBackend().kv_cache(2, 4, 16, 2, 48, kv_type="q8_0")


def test_table_rows_follow_growing_and_replaced_lists():
    """Rows kept between steps equal each sequence's list of blocks, zero past it, as its list grows (past the width
    too), is replaced by another list (preemption, a new request under the same id) or shrinks; sequences that leave
    the batch are forgotten."""
    rng = np.random.default_rng()
    rows = TableRows(width=8)
    tables = {s: rng.integers(0, 100, int(rng.integers(1, 8))).tolist() for s in range(5)}
    for step in range(40):
        s = int(rng.integers(0, 6))
        change = rng.integers(0, 4)
        if change == 0:
            tables.setdefault(s, []).append(int(rng.integers(0, 100)))       # a block appended (the same list)
        elif change == 1:
            tables[s] = rng.integers(0, 100, int(rng.integers(0, 12))).tolist()   # replaced, up to past the width
        elif change == 2 and s in tables:
            del tables[s]
        got = rows.of(tables)
        assert set(got) == set(tables) == set(rows.rows)
        for t, blocks in tables.items():
            want = np.zeros(max(8, len(blocks)), np.int32)
            want[:len(blocks)] = blocks
            assert np.array_equal(got[t], want), (step, t)
