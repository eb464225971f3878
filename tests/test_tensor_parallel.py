"""Tensor parallelism on the CPU stand-in: N ranks as threads of one process on the numpy backend, each holding its
shard (engine/parallel/shard.py), joined by the same all-reduce and gather the GPU ranks do over NCCL. The split
model's float64 logits equal the whole model's; its greedy tokens are the same."""
import numpy as np
import pytest

from engine.gguf import GGUFFile
from engine.model.config import ModelConfig
from engine.parallel.group import ParallelError
from engine.parallel.shard import FF_COLS, Q_COLS, Shard, ShardError, ffn_unit, plan
from engine.quants import GGMLType, dequantize, random_blocks
from engine.gguf import TensorInfo
from engine.runtime import Runtime
from engine.sampling import SamplingParams
from tiny_archs import ARCHS, prompt_tokens, write_arch
from tiny_models import write_tiny

EXACT = 1e-10     # float64 logits of the split model against the whole model's (max abs difference)


def config(n_head, n_head_kv, n_ff=1024, n_vocab=1000, head_dim=64):
    return ModelConfig("llama", 1, 512, n_ff, n_head, n_head_kv, head_dim, head_dim, 1e4, 1e-6, 1024, n_vocab)


@pytest.mark.parametrize("heads", [(9, 3), (4, 1), (32, 8), (8, 2), (6, 6), (12, 4)])
@pytest.mark.parametrize("size", [2, 3, 4, 8])
def test_plan_covers_every_head_once_and_keeps_gqa(heads, size):
    n_head, n_kv = heads
    cfg = config(n_head, n_kv)
    if n_head < size:
        with pytest.raises(ShardError, match="attention heads"):
            plan(cfg, size)
        return
    shards = plan(cfg, size, ff_unit=256)
    assert [h for s in shards for h in s.q_heads] == list(range(n_head))
    assert [c for s in shards for c in s.ff] == list(range(cfg.n_ff))
    assert [v for s in shards for v in s.vocab] == list(range(cfg.n_vocab))
    group = n_head // n_kv
    for s in shards:
        assert len(s.q_heads) % len(s.kv_heads) == 0
        local_group = len(s.q_heads) // len(s.kv_heads)
        for i, h in enumerate(s.q_heads):            # a rank's attention is plain GQA over the KV heads it holds
            assert s.kv_heads[i // local_group] == h // group
        if s.ff.start % 256 == 0 and cfg.n_ff // 256 >= size:
            assert s.ff.stop % 256 == 0


def test_cut_inside_blocks_is_held_as_f32():
    rng = np.random.default_rng()
    rows, cols = 8, 512
    data = random_blocks(GGMLType.Q4_K, rows * cols // 256, rng).reshape(-1)
    info = TensorInfo("blk.0.attn_output.weight", GGMLType.Q4_K, (cols, rows), 0, data.nbytes)
    whole = dequantize(data, GGMLType.Q4_K, (rows, cols))
    cfg = config(8, 8, n_ff=cols, head_dim=64)
    aligned = plan(cfg, 2, ff_unit=256)[1]             # columns 256..512: whole blocks
    part_info, part = aligned.cut(info, data, FF_COLS)
    assert part_info.type == GGMLType.Q4_K and not aligned.expanded
    assert np.array_equal(dequantize(part, part_info.type, part_info.np_shape), whole[:, 256:])
    inside = plan(cfg, 4)[1]                           # heads 2..4: columns 128..256, inside the first block
    part_info, part = inside.cut(info, data, Q_COLS)
    assert part_info.type == GGMLType.F32 and inside.expanded
    assert np.array_equal(dequantize(part, part_info.type, part_info.np_shape), whole[:, 128:256])


def split_and_whole(path, size, **kw):
    whole = Runtime(GGUFFile(path), device="cpu", exact=True, **kw)
    split = Runtime(GGUFFile(path), device="cpu", exact=True, tensor_parallel=size, **kw)
    return whole, split


def logits64(rt, tokens):
    """float64 logits of every position of one ubatch (the backend's own array, not the float32 copy)."""
    return np.asarray(rt.prefill(tokens, all_logits=True, on_device=True), dtype=np.float64)


def greedy_decode(rt, prompt, n):
    """n greedy tokens through the decode path -> (tokens, float64 logits of each step)."""
    logits = logits64(rt, prompt)[-1:]
    toks, steps = [], []
    for i in range(n):
        steps.append(logits[0])
        toks.append(int(np.argmax(logits[0])))
        b = rt.forward([toks[-1]], [len(prompt) + i], [0], [0])
        logits = np.asarray(b, dtype=np.float64)
    return toks, np.array(steps)


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("size", [2, 3, 4])
def test_tiny_architectures_split_equal_whole(tmp_path, name, size):
    """Biases, fused tensors (Phi-3), capped scores and logits (Gemma 2), every rope variant, mixtures of experts
    (each expert split by its columns, Qwen 2 MoE's shared expert too), uneven splits."""
    path = write_arch(tmp_path / f"{name}.gguf", name)
    whole, split = split_and_whole(path, size, n_ctx=128)
    prompt = prompt_tokens()
    assert np.abs(logits64(split, prompt) - logits64(whole, prompt)).max() <= EXACT
    toks_w, steps_w = greedy_decode(whole, prompt, 8)
    toks_s, steps_s = greedy_decode(split, prompt, 8)
    assert toks_s == toks_w
    assert np.abs(steps_s - steps_w).max() <= EXACT


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("size", [2, 4])
def test_kquant_splits_inside_blocks(tmp_path, arch, size):
    """K-quant attn_output / ffn_down whose split boundary falls inside a 256-block: held as f32, still exact."""
    path = write_tiny(tmp_path / f"{arch}.gguf", arch)
    whole, split = split_and_whole(path, size, n_ctx=128)
    shards = [split.model.shard] + [r.state.model.shard for r in split.model.group.ranks]
    assert any(s.expanded for s in shards)
    prompt = list(np.random.default_rng().integers(0, 320, 40))
    assert np.abs(logits64(split, prompt) - logits64(whole, prompt)).max() <= EXACT


def test_scheduler_batches_and_shared_prefixes(tmp_path, monkeypatch):
    """Several sequences in one step, prompts that reuse a cached prefix (copied between slots): every rank's cache
    follows rank 0's, the tokens equal the whole model's."""
    from engine.parallel.group import ParallelCache
    from engine.scheduler import Request, Scheduler, TokenEvent
    copies = []
    copy_prefix = ParallelCache.copy_prefix
    monkeypatch.setattr(ParallelCache, "copy_prefix", lambda self, *a: (copies.append(a), copy_prefix(self, *a)))
    path = write_arch(tmp_path / "llama3.gguf", "llama3")
    shared = prompt_tokens(seed=1, n=40)
    waves = [[shared + [5, 6], prompt_tokens(seed=2, n=20), shared[:36] + [1]], [shared + [7], shared[:38] + [9, 9]]]
    outs, hits = [], []
    for size in (1, 2):
        rt = Runtime(GGUFFile(path), device="cpu", exact=True, n_ctx=128, n_seq=3, tensor_parallel=size)
        sched = Scheduler(rt, 16)
        events = []
        for wave in waves:                       # the second wave finds the first's prompts in the slots
            for p in wave:
                ev = []
                events.append(ev)
                sched.submit(Request(p, SamplingParams(temperature=0), 10, ignore_eos=True), ev.append)
            while sched.step():
                pass
        outs.append([[e.token for e in ev if isinstance(e, TokenEvent)] for ev in events])
        hits.append(sched.stats.prefix_cache_hits)
    assert outs[0] == outs[1] and all(len(t) == 10 for t in outs[0])
    assert hits[0] == hits[1] >= 2 and copies


def test_embeddings_and_output_are_split_by_vocabulary(tmp_path):
    """Each rank holds its vocabulary rows of token_embd (tied: the output matrix is the same shard); a token's
    embedding comes from its rank, zeros from the others."""
    path = write_arch(tmp_path / "gemma2.gguf", "gemma2")
    rt = Runtime(GGUFFile(path), device="cpu", exact=True, n_ctx=64, tensor_parallel=3)
    models = [rt.model.local] + [r.state.model for r in rt.model.group.ranks]
    assert [m.tok_embd.shape[0] for m in models] == [len(m.shard.vocab) for m in models]
    assert sum(len(m.shard.vocab) for m in models) == rt.config.n_vocab
    assert all(m.output is m.tok_embd for m in models) == (GGUFFile(path).tensors.get("output.weight") is None)
    tokens = np.array([0, 150, 319, 106, 107], np.int32)
    ours = models[1].B.embed(models[1].tok_embd, tokens, models[1].shard.vocab.start)
    v = models[1].shard.vocab
    for t, row in zip(tokens, ours):
        assert (row == models[1].tok_embd[t - v.start]).all() if t in v else not row.any()


@pytest.mark.parametrize("size", [2, 3])
def test_process_ranks_equal_whole(tmp_path, size):
    """Ranks as processes (the GPU ranks' protocol: spawn, start, ready, operations acknowledged over pipes), their
    sums through rank 0: the same float64 logits as the whole model, through prefill, decode and a copied prefix."""
    from engine.parallel.group import load_parallel
    path = write_arch(tmp_path / "qwen2.gguf", "qwen2")
    whole = Runtime(GGUFFile(path), device="cpu", exact=True, n_ctx=64, n_seq=2)
    backend, model = load_parallel(GGUFFile(path), size, device="cpu", exact=True, processes=True)
    try:
        assert all(r.process.is_alive() for r in model.group.ranks) and len(model.group.ranks) == size - 1
        model.set_context(64)
        cache = model.new_cache(2, 64)                  # two blocks of a whole context: the batches name them
        whole_cache = whole.model.new_cache(2, 64)
        from engine.backends.base import Batch
        prompt = prompt_tokens(n=20)
        got = backend.forward(model, Batch.single(prompt, 0, 0, all_logits=True), cache)
        want = whole.backend.forward(whole.model, Batch.single(prompt, 0, 0, all_logits=True), whole_cache)
        assert np.abs(got - want).max() <= EXACT
        cache.copy_prefix(0, 1, 20)                     # block 1 continues from block 0's prefix on every rank
        whole_cache.copy_prefix(0, 1, 20)
        step = Batch.make([5, 7], [20, 20], [0, 1], [0, 1])
        assert np.abs(backend.forward(model, step, cache) -
                      whole.backend.forward(whole.model, step, whole_cache)).max() <= EXACT
    finally:
        backend.close()


def test_ranks_join_from_another_host(tmp_path):
    """Ranks 1 and 2 on "another host": `engine tp-worker` connects to rank 0's --tp-listen with the key, gets its
    shards and the device, and the split equals the whole model. Before that, a wrong key is refused by the
    handshake and a rank the group does not wait for is told so."""
    import subprocess
    import sys
    import threading
    import time
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Client
    from engine.backends.base import Batch
    from engine.parallel.config import ParallelConfig, address
    from engine.parallel.group import load_parallel
    from test_server import free_port
    path = write_arch(tmp_path / "gemma2.gguf", "gemma2")
    listen = f"127.0.0.1:{free_port()}"
    loaded = {}
    rank0 = threading.Thread(target=lambda: loaded.update(group=load_parallel(
        GGUFFile(path), ParallelConfig(3, local=1, listen=listen, key="secret"), device="cpu", exact=True)))
    rank0.start()

    def connect(key):
        deadline = time.time() + 30
        while True:
            try:
                return Client(address(listen), authkey=key)
            except ConnectionRefusedError:
                assert time.time() < deadline
                time.sleep(0.1)
    with pytest.raises(AuthenticationError):
        connect(b"wrong")
    stray = connect(b"secret")
    stray.send(("hello", 7))
    tag, why = stray.recv()
    assert tag == "refused" and "rank 7" in why
    workers = subprocess.Popen([sys.executable, "-m", "engine.cli", "tp-worker", listen, "--ranks", "1-2", "--key",
                                "secret", "--wait", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        rank0.join(120)
        backend, model = loaded["group"]
        whole = Runtime(GGUFFile(path), device="cpu", exact=True, n_ctx=64)
        model.set_context(64)
        cache = model.new_cache(1, 64)
        batch = Batch.single(prompt_tokens(n=24), 0, 0, all_logits=True)
        got = backend.forward(model, batch, cache)
        assert np.abs(got - whole.backend.forward(whole.model, batch, whole.model.new_cache(1, 64))).max() <= EXACT
        backend.close()
        assert workers.wait(30) == 0, workers.stdout.read()
    finally:
        workers.kill()


def test_a_stopped_rank_process_is_an_error_not_a_hang(tmp_path):
    from engine.parallel.group import ParallelError, load_parallel
    from engine.backends.base import Batch
    path = write_arch(tmp_path / "llama3.gguf", "llama3")
    backend, model = load_parallel(GGUFFile(path), 2, device="cpu", exact=True, processes=True)
    model.set_context(64)
    cache = model.new_cache(1, 64)
    rank1 = model.group.ranks[0].process
    rank1.kill()
    rank1.join(10)
    with pytest.raises(Exception, match="rank 1"):
        backend.forward(model, Batch.single(prompt_tokens(n=8), 0, 0), cache)
    with pytest.raises(ParallelError, match="broken"):
        backend.forward(model, Batch.single(prompt_tokens(n=8), 0, 0), cache)
    backend.close()


def test_a_failing_rank_breaks_the_group_with_an_error(tmp_path):
    path = write_arch(tmp_path / "llama3.gguf", "llama3")
    rt = Runtime(GGUFFile(path), device="cpu", exact=True, n_ctx=64, tensor_parallel=2)
    rank1 = rt.model.group.ranks[0].state
    rank1.forward = lambda batch: (_ for _ in ()).throw(MemoryError("rank 1 out of memory"))
    with pytest.raises(Exception):
        rt.prefill(prompt_tokens(n=8))
    with pytest.raises(ParallelError, match="broken"):
        rt.prefill(prompt_tokens(n=8))


def test_more_ranks_than_heads_is_refused(tmp_path):
    path = write_arch(tmp_path / "llama3.gguf", "llama3")
    with pytest.raises(ShardError, match="4 attention heads"):
        Runtime(GGUFFile(path), device="cpu", tensor_parallel=8)


_whole = {}   # key -> (prompt, logits, greedy tokens, step logits) of the unsplit real model


@pytest.mark.slow
@pytest.mark.parametrize("key", ["smol", "gemma"])
@pytest.mark.parametrize("size", [2, 4])
def test_real_models_split_equal_whole(model_path, key, size):
    """Both real models at N = 2 and 4: float64 logits to 1e-10, greedy-32 through the decode path identical."""
    path = model_path(key)
    f = GGUFFile(path)
    cfg = ModelConfig.from_gguf(f)
    assert all(s.ff.start % ffn_unit(f, cfg.n_ff) == 0 for s in plan(cfg, size, ffn_unit(f, cfg.n_ff)))
    if key not in _whole:                       # the unsplit model's results, the same for every split size
        whole = Runtime(f, device="cpu", exact=True, n_ctx=256)
        prompt = whole.tokenizer.encode("The three most important inventions of the twentieth century were")
        _whole[key] = (prompt, logits64(whole, prompt), *greedy_decode(whole, prompt, 32))
    prompt, logits_w, toks_w, steps_w = _whole[key]
    split = Runtime(GGUFFile(path), device="cpu", exact=True, tensor_parallel=size, n_ctx=256)
    assert np.abs(logits64(split, prompt) - logits_w).max() <= EXACT
    toks_s, steps_s = greedy_decode(split, prompt, 32)
    assert toks_s == toks_w
    assert np.abs(steps_s - steps_w).max() <= EXACT


@pytest.mark.slow
def test_serve_split_over_two_ranks(model_path):
    """`engine serve -tp 2` (the engine core then starts the other rank): the same greedy completion as `engine
    generate` without the split, and a clean exit on SIGTERM."""
    import httpx
    from test_server import PROMPT, generate_cli, start_server
    model_path("smol")
    proc, base = start_server("-tp", "2", "--parallel", "2")
    try:
        r = httpx.post(base + "/v1/completions", json={"model": "smollm2-135m", "prompt": PROMPT, "max_tokens": 12,
                                                       "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == generate_cli(PROMPT, 12)["text"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) is not None


def test_engine_core_reports_a_broken_group_and_stops(tmp_path):
    """A server's engine core whose rank fails: the step's requests end with the error, then the core sends Fatal
    (the front end answers 503 from then on) and leaves its loop, instead of failing every later request."""
    import threading
    import msgspec
    import zmq
    from server.core import CoreConfig, EngineCore
    from server.messages import AddRequest, Fatal, Outputs, encoder
    path = write_arch(tmp_path / "llama3.gguf", "llama3")
    core = EngineCore(CoreConfig(path, device="cpu", n_parallel=2, n_ctx=64, warmup=False, tensor_parallel=2))
    rank1 = core.rt.model.group.ranks[0].state
    rank1.forward = lambda batch: (_ for _ in ()).throw(MemoryError("rank 1 out of memory"))
    ctx = zmq.Context()
    to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_out, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    to_core.bind("inproc://in")
    core_in.connect("inproc://in")
    from_core.bind("inproc://out")
    core_out.connect("inproc://out")
    loop = threading.Thread(target=core.serve, args=(core_in, core_out), daemon=True)
    loop.start()
    to_core.send(encoder.encode(AddRequest(rid=1, prompt=prompt_tokens(n=6), max_tokens=4)))
    decoder = msgspec.msgpack.Decoder(Outputs | Fatal)
    events, fatal = [], None
    while fatal is None:
        assert from_core.poll(30_000), "the core went silent"
        msg = decoder.decode(from_core.recv())
        if isinstance(msg, Fatal):
            fatal = msg
        else:
            events += msg.events
    loop.join(10)
    assert not loop.is_alive()
    assert [e.finish for e in events if e.rid == 1] == ["error"] and "out of memory" in events[-1].error
    assert "tensor-parallel group is broken" in fatal.error and "rank 1 out of memory" in fatal.error
    for s in (to_core, core_in, core_out, from_core):
        s.close(0)
    ctx.term()


def test_q8_0_kv_cache_split_equals_whole(tmp_path):
    """Each rank quantizes its own KV heads into q8_0 blocks (32 values of one head each), so the split model with a
    q8_0 cache equals the whole one with a q8_0 cache, through a prefill and decode steps."""
    path = write_tiny(tmp_path / "llama.gguf", "llama")
    whole, split = split_and_whole(path, 2, n_ctx=64, kv_type="q8_0")
    prompt = prompt_tokens(n=30)
    assert np.abs(logits64(split, prompt) - logits64(whole, prompt)).max() <= EXACT
    toks_s, steps_s = greedy_decode(split, prompt, 6)
    toks_w, steps_w = greedy_decode(whole, prompt, 6)
    assert toks_s == toks_w and np.abs(steps_s - steps_w).max() <= EXACT
    assert type(whole.cache).__name__ == "Q8KVCache"
