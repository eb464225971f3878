"""Each CUDA backend operation against the numpy backend, fresh random inputs (GPU only)."""
import numpy as np
import pytest

from engine.backends.base import Batch
from engine.backends.cpu import CPUBackend
from engine.cuda.config import forced
from engine.model.rope import inv_freq

pytestmark = pytest.mark.gpu


def nmse(a, b):
    return float(np.sum((np.asarray(a, np.float64) - b) ** 2) / np.sum(np.asarray(b, np.float64) ** 2))


@pytest.fixture(scope="module")
def backends():
    from engine.backends.cuda import CUDABackend
    return CPUBackend(), CUDABackend(), CUDABackend(kv_f32=True)


def test_rms_norm(backends):
    import cupy as cp
    cpu, gpu, _ = backends
    rng = np.random.default_rng()
    for shape in [(7, 640), (5, 4, 256), (1, 576), (3, 2560), (2, 4096), (1, 8224)]:   # 2, 4, 4, 16 values a thread
        x = rng.standard_normal(shape).astype(np.float32) * 3
        w = rng.standard_normal(shape[-1]).astype(np.float32)
        y = gpu.rms_norm(cp.asarray(x), cp.asarray(w), 1e-6).get()
        assert nmse(y, cpu.rms_norm(x, w, 1e-6)) < 1e-12


def assert_q8_1_written(gpu, y):
    """The q8_1 blocks a kernel registered for y (with the residual plane at one row, dispatch.residual_rows) are
    those quantize_q8_1 writes, bit for bit."""
    import cupy as cp
    from engine.cuda import dispatch, launch
    residual = dispatch.residual_rows(y.shape[0])
    key = "q8_1r" if residual else ("q8_1", None)
    assert gpu.acts.x is y and key in gpu.acts.forms
    for got, ref in zip(gpu.acts.forms[key], launch.quantize_q8_1(y, residual=residual), strict=True):
        assert cp.array_equal(got, ref)


def assert_f16_written(gpu, y):
    """The f16 form a kernel registered for y (dispatch.writes_f16: a mul_mat past the decode rows takes it) is
    y.astype(float16), bit for bit."""
    import cupy as cp
    assert gpu.acts.x is y and "f16" in gpu.acts.forms
    assert cp.array_equal(gpu.acts.forms["f16"].view(cp.uint16), y.astype(cp.float16).view(cp.uint16))


@pytest.mark.parametrize("post_norm", [False, True])
def test_add_rms_norm(backends, post_norm):
    import cupy as cp
    cpu, gpu, _ = backends
    rng = np.random.default_rng()
    for shape in [(7, 640), (1, 576), (3, 2304), (1, 4096), (2, 5120), (1, 8192), (9, 576), (40, 4096)]:
        x, r = (rng.standard_normal(shape).astype(np.float32) * 3 for _ in range(2))
        w, wr = (rng.standard_normal(shape[-1]).astype(np.float32) for _ in range(2))
        ref_s, ref_y = cpu.add_rms_norm(x, r, w, 1e-6, r_norm=wr if post_norm else None)
        s, y = gpu.add_rms_norm(cp.asarray(x), cp.asarray(r), cp.asarray(w), 1e-6,
                                r_norm=cp.asarray(wr) if post_norm else None)
        assert nmse(s.get(), ref_s) < 1e-12 and nmse(y.get(), ref_y) < 1e-12
        if shape[0] >= 9:                             # more rows: y's f16 form comes with it, as a cast writes
            assert_f16_written(gpu, y)
        if shape[0] <= 8:                             # a decode step: y's q8_1 blocks come with it, as quantize writes
            assert_q8_1_written(gpu, y)
            with forced(exact_decode=True):           # and at one row on 16-bit activations, their residual plane
                _, y = gpu.add_rms_norm(cp.asarray(x), cp.asarray(r), cp.asarray(w), 1e-6,
                                        r_norm=cp.asarray(wr) if post_norm else None)
                assert_q8_1_written(gpu, y)


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_rope_qk(backends, neox, norm):
    """q and k in one launch, optionally each head RMS-normed first (Gemma 3), against the numpy backend; plain
    frequencies and Llama 3's per-pair factors, LongRoPE's attention factor on the rotated dims."""
    import cupy as cp
    cpu, gpu, _ = backends
    rng = np.random.default_rng()
    for n, n_head, n_kv, hd, n_rot in [(9, 6, 2, 64, 64), (1, 4, 1, 256, 256), (5, 3, 3, 128, 64)]:
        q = rng.standard_normal((n, n_head, hd)).astype(np.float32) * 2
        k = rng.standard_normal((n, n_kv, hd)).astype(np.float32) * 2
        qn, kn = (rng.standard_normal(hd).astype(np.float32) if norm else None for _ in range(2))
        pos = rng.integers(0, 30000, n).astype(np.int32)
        freqs = inv_freq(n_rot, 10000.0, freq_factors=rng.uniform(1, 8, n_rot // 2) if n % 2 else None)
        mscale = 1.3 if n % 2 else 1.0                        # LongRoPE's attention factor
        ref_q, ref_k = cpu.rope_qk(q, k, pos, freqs, neox, qn, kn, 1e-6, mscale)
        yq, yk = gpu.rope_qk(cp.asarray(q), cp.asarray(k), pos, freqs, neox,
                             None if qn is None else cp.asarray(qn), None if kn is None else cp.asarray(kn), 1e-6,
                             mscale)
        np.testing.assert_allclose(yq.get(), ref_q, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(yk.get(), ref_k, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("neox", [False, True])
def test_rope(backends, neox):
    import cupy as cp
    cpu, gpu, _ = backends
    rng = np.random.default_rng()
    for n, heads, hd, n_rot in [(9, 3, 64, 64), (4, 2, 256, 256), (3, 5, 128, 64)]:
        x = rng.standard_normal((n, heads, hd)).astype(np.float32)
        pos = rng.integers(0, 5000, n).astype(np.int32)
        freqs = inv_freq(n_rot, 10000.0, freq_factors=rng.uniform(1, 8, n_rot // 2) if n % 2 else None)
        mscale = 1.3 if n % 2 else 1.0
        y = gpu.rope(cp.asarray(x), pos, freqs, neox, mscale).get()
        np.testing.assert_allclose(y, cpu.rope(x, pos, freqs, neox, mscale), rtol=1e-5, atol=1e-5)


# (mixed) two sequences: a 6-token prefill continuing at position 3 and a one-token decode at 10, few queries: the
# decode kernel; (prefill) 100 tokens of one sequence from position 20: the tiled prefill kernel; (two) 60 tokens of
# each of two sequences: one warp per query; (decode) two decode steps deep in the context: several chunks of keys
# per head; (decode_many) 40 sequences' decode rows; (per_row) a replayed mixed step's layout, 40 rows each its own
# query; (chunks) an eager server step: two decode rows, then prefill chunks of 20, 1 and 37 tokens of three
# sequences, the chunks in one tiled launch (partial tiles, a one-row tile)
ATTENTION_BATCHES = {"mixed": ([1] * 6 + [0], list(range(3, 9)) + [10]),
                     "chunks": ([3, 4] + [0] * 20 + [1] + [2] * 37, [40, 77] + list(range(30, 50)) + [90] +
                                list(range(37))),
                     "decode": ([0, 1], [100, 90]),
                     "decode_many": (list(range(40)), [(37 * i) % 120 + 1 for i in range(40)]),
                     "per_row": ([0, 1] + [2] * 20 + [3] * 18, [50, 7] + list(range(30, 50)) + list(range(100, 118))),
                     "prefill": ([0] * 100, list(range(20, 120))),
                     "two": ([1] * 60 + [0] * 60, list(range(60)) + list(range(5, 65)))}
# (head_dim, n_head, n_kv): GQA groups of 3, 24 (two tensor-core decode blocks a KV head, three SIMT ones), 3 (a
# head size the tensor-core decode kernel lacks: the SIMT one on an f16 cache), 4 and 16
ATTENTION_HEADS = [(64, 9, 3), (64, 48, 2), (96, 6, 2), (128, 8, 2), (256, 16, 1)]


def q8_0_rows(q, scale):
    """(int8 [..., d], f16 [..., d // 32]) -> GGML's q8_0 blocks of each row, [..., d // 32 * 34] uint8."""
    blocks = q.reshape(*q.shape[:-1], -1, 32).view(np.uint8)
    return np.concatenate([scale[..., None].view(np.uint8), blocks], axis=-1).reshape(*q.shape[:-1], -1)


def attention_caches(backend, rng, n_seq, n_ctx, n_kv, d, layout, spare=5, kv_type=None):
    """KV caches of random contents on the numpy backend and on `backend`, equal, and the sequences' block tables
    (None: one whole-context block per sequence; paged: blocks of 16 in a random order, spare blocks among them);
    kv_type "q8_0": both caches in q8_0 blocks."""
    import cupy as cp
    bs = n_ctx if layout == "whole" else 16
    per = n_ctx // bs
    n_blocks = n_seq * per + (0 if layout == "whole" else spare)
    tables = None
    if layout == "paged":
        order = rng.permutation(n_blocks)[:n_seq * per].reshape(n_seq, per)
        tables = {s: order[s].tolist() for s in range(n_seq)}
    contents = rng.standard_normal((2, n_blocks, bs, n_kv, d)).astype(np.float32)
    if kv_type == "q8_0":
        from engine.backends.cpu import quantize_q8_0
        ccache = CPUBackend().kv_cache(1, n_blocks, bs, n_kv, d, kv_type="q8_0")
        gcache = backend.kv_cache(1, n_blocks, bs, n_kv, d, kv_type="q8_0")
        for i, (values, scales, dst) in enumerate(((ccache.k, ccache.k_scale, gcache.k),
                                                   (ccache.v, ccache.v_scale, gcache.v))):
            values[0][:], scales[0][:] = quantize_q8_0(contents[i])
            dst[0][:n_blocks] = cp.asarray(q8_0_rows(values[0], scales[0]))
        return ccache, gcache, tables
    ccache = CPUBackend().kv_cache(1, n_blocks, bs, n_kv, d)
    ccache.k[0][:], ccache.v[0][:] = contents
    gcache = backend.kv_cache(1, n_blocks, bs, n_kv, d)
    gcache.k[0][:n_blocks] = cp.asarray(contents[0]).astype(gcache.k[0].dtype)   # past them: the spare pad block
    gcache.v[0][:n_blocks] = cp.asarray(contents[1]).astype(gcache.v[0].dtype)
    return ccache, gcache, tables


@pytest.mark.parametrize("layout", ["whole", "paged"])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("kind", ATTENTION_BATCHES)
@pytest.mark.parametrize("d, n_head, n_kv", ATTENTION_HEADS)
def test_attention(backends, window, kind, d, n_head, n_kv, softcap, layout):
    """Every attention kernel (decode, per-row, prefill on tensor cores and SIMT, two sequences) against the numpy
    backend, over whole-context blocks and over paged ones; softcap 2.0: Gemma 2's capped scores (the scaled scores
    here reach about 1-4)."""
    import cupy as cp
    cpu, gpu16, gpu32 = backends
    rng = np.random.default_rng()
    n_ctx = 128
    seq_ids, positions = ATTENTION_BATCHES[kind]
    n, n_seq = len(seq_ids), max(2, max(seq_ids) + 1)
    q = rng.standard_normal((n, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    for gpu, bound in [(gpu32, 1e-10), (gpu16, 1e-5)]:
        ccache, gcache, tables = attention_caches(gpu, rng, n_seq, n_ctx, n_kv, d, layout)
        batch = Batch.make(np.zeros(n), positions, seq_ids, np.arange(n), tables)
        batch.per_row = kind == "per_row"
        if gpu is gpu16:                                 # the reference reads the f16 cache's values
            ccache.k[0][:] = gcache.k[0][:-1].get()
            ccache.v[0][:] = gcache.v[0][:-1].get()
        ref = cpu.attention(q, k, v, ccache, 0, batch, 0.125, window, softcap)
        res = gpu.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), gcache, 0, batch, 0.125, window, softcap)
        out = res.get()
        assert nmse(out, ref) < bound, (gpu.kv_dtype, nmse(out, ref))
        if gpu.acts.x is res:                           # the decode kernel also wrote the output's q8_1 blocks
            assert_q8_1_written(gpu, res)
            if n >= 9:                                  # (and past the decode rows its f16 form)
                assert_f16_written(gpu, res)
            with forced(exact_decode=True):             # (at one row on 16-bit activations: the residual plane)
                res = gpu.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), gcache, 0, batch, 0.125, window,
                                    softcap)
                assert_q8_1_written(gpu, res)


@pytest.mark.parametrize("layout", ["whole", "paged"])
@pytest.mark.parametrize("window, softcap", [(None, 0.0), (70, 2.0)])
@pytest.mark.parametrize("kind", ATTENTION_BATCHES)
@pytest.mark.parametrize("d, n_head, n_kv", ATTENTION_HEADS)
def test_attention_q8_0_cache(backends, window, kind, d, n_head, n_kv, softcap, layout):
    """Every attention kernel over a q8_0 cache (llama.cpp's -ctk/-ctv q8_0) against the numpy backend's q8_0 cache:
    the same output (both compute in f32 from the same dequantized values), and the new keys and values stored in
    the same blocks, bit for bit (kv_store_q8_0, and the decode kernel's own store)."""
    import cupy as cp
    cpu, gpu, _ = backends
    rng = np.random.default_rng()
    seq_ids, positions = ATTENTION_BATCHES[kind]
    n, n_seq = len(seq_ids), max(2, max(seq_ids) + 1)
    q = rng.standard_normal((n, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    ccache, gcache, tables = attention_caches(gpu, rng, n_seq, 128, n_kv, d, layout, kv_type="q8_0")
    assert gcache.k[0].dtype == np.uint8 and gcache.k[0].shape[-1] == d // 32 * 34
    batch = Batch.make(np.zeros(n), positions, seq_ids, np.arange(n), tables)
    batch.per_row = kind == "per_row"
    ref = cpu.attention(q, k, v, ccache, 0, batch, 0.125, window, softcap)
    out = gpu.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), gcache, 0, batch, 0.125, window, softcap).get()
    assert nmse(out, ref) < 1e-10, nmse(out, ref)
    for values, scales, ours in ((ccache.k, ccache.k_scale, gcache.k), (ccache.v, ccache.v_scale, gcache.v)):
        assert np.array_equal(ours[0][:-1].get(), q8_0_rows(values[0], scales[0]))


@pytest.mark.parametrize("layout", ["whole", "paged"])
@pytest.mark.parametrize("n_ctx, n", [(4096, 24), (20000, 6)])
@pytest.mark.parametrize("n_head, n_kv, d", [(16, 4, 128), (4, 1, 256)])
def test_decode_attention_batch_invariant(backends, layout, n_ctx, n, n_head, n_kv, d):
    """A decode row's attention is the same, bit for bit, alone and among other rows of other lengths: its chunks of
    keys follow its own length and the model's chunk cap (four blocks a row: about 66 chunks on 132 multiprocessors;
    one block a row: up to DECODE_MAX_CHUNKS, so 20,000 keys take over 64 chunks), never the batch; and it is the
    numpy backend's."""
    import cupy as cp
    cpu, gpu, _ = backends
    rng = np.random.default_rng()
    positions = rng.integers(1, n_ctx, n)
    _, gcache, tables = attention_caches(gpu, rng, n, n_ctx, n_kv, d, layout)
    q = cp.asarray(rng.standard_normal((n, n_head, d)).astype(np.float32))
    k, v = (cp.asarray(rng.standard_normal((n, n_kv, d)).astype(np.float32)) for _ in range(2))
    batch = Batch.make(np.zeros(n), positions, np.arange(n), np.arange(n), tables)
    together = gpu.attention(q, k, v, gcache, 0, batch, 0.125, None).get()
    for i in rng.choice(n, min(n, 6), replace=False):
        one = Batch.make([0], [positions[i]], [i], [0], None if tables is None else {int(i): tables[i]})
        alone = gpu.attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], gcache, 0, one, 0.125, None).get()
        assert np.array_equal(alone[0], together[i]), (i, positions[i])
    ccache = CPUBackend().kv_cache(1, gcache.n_blocks - 1, gcache.block_size, n_kv, d)
    ccache.k[0][:], ccache.v[0][:] = gcache.k[0][:-1].get(), gcache.v[0][:-1].get()
    ref = cpu.attention(q.get(), k.get(), v.get(), ccache, 0, batch, 0.125, None)
    assert nmse(together, ref) < 1e-5


def test_glu_and_embed(backends):
    import cupy as cp
    from engine.cuda.weights import upload
    from engine.quants import GGMLType, dequantize, random_blocks
    cpu, gpu, _ = backends
    rng = np.random.default_rng()
    for rows in (5, 9, 33):                             # from 9 rows each writes its f16 form too
        g, u = (rng.standard_normal((rows, 300)).astype(np.float32) * 3 for _ in range(2))
        for ours, ref in ((gpu.swiglu, cpu.swiglu), (gpu.geglu, cpu.geglu)):
            y = ours(cp.asarray(g), cp.asarray(u))
            assert nmse(y.get(), ref(g, u)) < 1e-12
            if rows >= 9:
                assert_f16_written(gpu, y)
    blocks = random_blocks(GGMLType.Q8_0, 50 * 8, rng)
    table = upload(GGMLType.Q8_0, (50, 256), blocks)
    tokens = rng.integers(0, 50, 9).astype(np.int32)
    np.testing.assert_array_equal(gpu.embed(table, tokens).get(), dequantize(blocks, GGMLType.Q8_0, (50, 256))[tokens])
    shard_tokens = rng.integers(0, 200, 9).astype(np.int32)        # a rank holding vocabulary rows 100..149
    np.testing.assert_array_equal(gpu.embed(table, shard_tokens, 100).get(),
                                  cpu.embed(dequantize(blocks, GGMLType.Q8_0, (50, 256)), shard_tokens, 100))


def test_argmax(backends):
    """Row-wise argmax on the device equals numpy's: the first maximum, also for ties and negative rows."""
    import cupy as cp
    _, gpu, _ = backends
    rng = np.random.default_rng()
    for n, m in [(1, 262144), (3, 49152), (5, 1000), (2, 7)]:
        x = rng.standard_normal((n, m)).astype(np.float32) * 5
        x[-1] -= 100.0                                                   # a row of negative values
        if m > 10:
            x[0, [m // 3, m // 2]] = x[0].max() + 1.0                   # a tie: the first one wins
        np.testing.assert_array_equal(gpu.argmax(cp.asarray(x)), np.argmax(x, axis=-1))
