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
    for shape in [(7, 640), (5, 4, 256), (1, 576)]:
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


@pytest.mark.parametrize("post_norm", [False, True])
def test_add_rms_norm(backends, post_norm):
    import cupy as cp
    cpu, gpu, _ = backends
    rng = np.random.default_rng()
    for shape in [(7, 640), (1, 576), (3, 2304)]:
        x, r = (rng.standard_normal(shape).astype(np.float32) * 3 for _ in range(2))
        w, wr = (rng.standard_normal(shape[-1]).astype(np.float32) for _ in range(2))
        ref_s, ref_y = cpu.add_rms_norm(x, r, w, 1e-6, r_norm=wr if post_norm else None)
        s, y = gpu.add_rms_norm(cp.asarray(x), cp.asarray(r), cp.asarray(w), 1e-6,
                                r_norm=cp.asarray(wr) if post_norm else None)
        assert nmse(s.get(), ref_s) < 1e-12 and nmse(y.get(), ref_y) < 1e-12
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


# (mixed) two sequences in slots 1 and 0: a 6-token prefill continuing at position 3 and a one-token decode at 10,
# few queries: the split-over-keys kernel; (prefill) 100 tokens of slot 0 from position 20: the tiled prefill
# kernel; (two) 60 tokens of each of two slots: one warp per query; (decode) two decode steps deep in the context:
# several chunks of keys per head; (decode_many) 40 sequences' decode rows, rows x heads past the GPU's block slots:
# the split kernel with one chunk per head; (per_row) a replayed mixed step's layout, 40 rows each its own query
ATTENTION_BATCHES = {"mixed": ([1] * 6 + [0], list(range(3, 9)) + [10]),
                     "decode": ([0, 1], [100, 90]),
                     "decode_many": (list(range(40)), [(37 * i) % 120 + 1 for i in range(40)]),
                     "per_row": ([0, 1] + [2] * 20 + [3] * 18, [50, 7] + list(range(30, 50)) + list(range(100, 118))),
                     "prefill": ([0] * 100, list(range(20, 120))),
                     "two": ([1] * 60 + [0] * 60, list(range(60)) + list(range(5, 65)))}


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("window", [None, 5, 70])
@pytest.mark.parametrize("kind", ATTENTION_BATCHES)
@pytest.mark.parametrize("d", [64, 128, 256])
def test_attention(backends, window, kind, d, softcap):
    """Every attention kernel (decode plain and split, per-row, prefill on tensor cores and SIMT, two sequences)
    against the numpy backend; softcap 2.0: Gemma 2's capped scores (the scaled scores here reach about 1-4)."""
    import cupy as cp
    cpu, gpu16, gpu32 = backends
    rng = np.random.default_rng()
    n_head, n_kv, n_ctx = 8, 2, 128
    seq_ids, positions = ATTENTION_BATCHES[kind]
    n, n_seq = len(seq_ids), max(2, max(seq_ids) + 1)
    batch = Batch.make(np.zeros(n), positions, seq_ids, np.arange(n))
    batch.per_row = kind == "per_row"
    ccache = cpu.kv_cache(1, n_seq, n_ctx, n_kv, d)
    history = rng.standard_normal((2, n_seq, n_ctx, n_kv, d)).astype(np.float32)  # what earlier steps stored
    ccache.k[0][:], ccache.v[0][:] = history[0], history[1]
    q = rng.standard_normal((n, n_head, d)).astype(np.float32)
    k = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    v = rng.standard_normal((n, n_kv, d)).astype(np.float32)
    ref = cpu.attention(q, k, v, ccache, 0, batch, 0.125, window, softcap)
    for gpu, bound in [(gpu32, 1e-10), (gpu16, 1e-5)]:
        gcache = gpu.kv_cache(1, n_seq, n_ctx, n_kv, d)
        gcache.k[0][:n_seq] = cp.asarray(history[0]).astype(gcache.k[0].dtype)     # past them: the spare pad slot
        gcache.v[0][:n_seq] = cp.asarray(history[1]).astype(gcache.v[0].dtype)
        res = gpu.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), gcache, 0, batch, 0.125, window, softcap)
        out = res.get()
        assert nmse(out, ref) < bound, (gpu.kv_dtype, nmse(out, ref))
        if gpu.acts.x is res:                           # the split kernel also wrote the output's q8_1 blocks
            assert_q8_1_written(gpu, res)
            with forced(exact_decode=True):             # (at one row on 16-bit activations: the residual plane)
                res = gpu.attention(cp.asarray(q), cp.asarray(k), cp.asarray(v), gcache, 0, batch, 0.125, window,
                                    softcap)
                assert_q8_1_written(gpu, res)


def test_glu_and_embed(backends):
    import cupy as cp
    from engine.cuda.weights import upload
    from engine.quants import GGMLType, dequantize, random_blocks
    cpu, gpu, _ = backends
    rng = np.random.default_rng()
    g, u = (rng.standard_normal((5, 300)).astype(np.float32) * 3 for _ in range(2))
    assert nmse(gpu.swiglu(cp.asarray(g), cp.asarray(u)).get(), cpu.swiglu(g, u)) < 1e-12
    assert nmse(gpu.geglu(cp.asarray(g), cp.asarray(u)).get(), cpu.geglu(g, u)) < 1e-12
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
