"""CUDA kernels against the numpy reference, fresh random inputs every run (GPU only)."""
import numpy as np
import pytest

from engine.quants import TYPES, GGMLType, dequantize, random_blocks

pytestmark = pytest.mark.gpu
QTYPES = [t for t in TYPES if TYPES[t].quantized]
NCOLS = [1, 2, 3, 5, 8, 9, 16, 17, 64, 127, 512, 513]


def shapes(t):
    """(m, k): rows and k that are not multiples of the tile sizes."""
    if TYPES[t].block_size == 256:
        return [(200, 1280), (77, 512)]
    return [(200, 608), (77, 1056)]


def q8_1_ref(x: np.ndarray):
    """numpy q8_1: per 32 values d = max|x|/127, q = roundf(x/d) -> (q [n,k] int8, dequantized [n,k] f64)."""
    n, k = x.shape
    b = x.reshape(n, k // 32, 32).astype(np.float32)
    amax = np.abs(b).max(axis=2, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(amax == 0, 0, b / d)
    q = np.where(v >= 0, np.floor(v + 0.5), np.ceil(v - 0.5)).astype(np.int8)
    return q.reshape(n, k), (q.astype(np.float64) * d.astype(np.float64)).reshape(n, k)


def q16_ref(x: np.ndarray):
    """numpy q8_1 with its residual plane (kernels/common.cuh warp_store_q8_1): r = roundf((x/d - q) * 254) ->
    (r [n,k] int8, the value d * (q + r / 254) [n,k] f64)."""
    n, k = x.shape
    b = x.reshape(n, k // 32, 32).astype(np.float32)
    amax = np.abs(b).max(axis=2, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(amax == 0, np.float32(0), b / d).astype(np.float32)
    q = np.where(v >= 0, np.floor(v + 0.5), np.ceil(v - 0.5)).astype(np.float32)
    t = ((v - q) * np.float32(254)).astype(np.float32)
    r = np.where(t >= 0, np.floor(t + 0.5), np.ceil(t - 0.5))
    value = d.astype(np.float64) * (q.astype(np.float64) + r.astype(np.float64) / 254)
    return r.astype(np.int8).reshape(n, k), value.reshape(n, k)


def mmvq_activations_ref(x: np.ndarray, t) -> np.ndarray:
    """The activations an MMVQ mul_mat of type t multiplies: 16-bit (q16_ref) where it takes the residual plane
    (mmvq.takes_residual: one column, CudaConfig.exact_decode), else q8_1-rounded."""
    from engine.cuda.mmvq import takes_residual
    return q16_ref(x)[1] if takes_residual(int(t), x.shape[0]) else q8_1_ref(x)[1]


def random_weight(t, m, k, rng):
    from engine.cuda.weights import upload
    info = TYPES[t]
    blocks = random_blocks(t, m * k // info.block_size, rng)
    return upload(t, (m, k), blocks), dequantize(blocks, t, (m, k)).astype(np.float64)


# mmq_f16 makes each weight d * q + m in one f16 fma with d and m rounded to f16 (kernels/mmq_f16.cu): simulated on
# Q4_K-like blocks, the products' nmse from exact weights is ~1e-7 (f16 weights rounded once from fp32: ~4e-8)
MMQ_F16_NMSE = 5e-7


def f16(a: np.ndarray) -> np.ndarray:
    """a rounded to f16, in float64."""
    return a.astype(np.float16).astype(np.float64)


def nmse(y, ref):
    return float(np.sum((y - ref) ** 2) / np.sum(ref ** 2))


def test_quantize_q8_1():
    import cupy as cp
    from engine.cuda import launch
    rng = np.random.default_rng()
    for n, k in [(1, 32), (7, 608), (130, 1280)]:
        x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 10)).astype(np.float32)
        x[0, :32] = 0.0   # an all-zero block
        qs, ds = launch.quantize_q8_1(cp.asarray(x), n_pad=n + 3)
        into = (cp.full(qs.shape, 7, cp.int8), cp.full(ds.shape, cp.nan, cp.float32))   # out=: the same bits there
        got = launch.quantize_q8_1(cp.asarray(x), n_pad=n + 3, out=into)
        assert got[0] is into[0] and got[1] is into[1]
        assert cp.array_equal(into[0], qs) and cp.array_equal(into[1], ds)
        q_ref, _ = q8_1_ref(x)
        qs, ds = qs.get(), ds.get().reshape(n + 3, k // 16, 2)
        assert np.array_equal(qs[:n], q_ref)
        assert not qs[n:].any() and not ds[n:].any()
        d_ref = (np.abs(x.reshape(n, k // 32, 32)).max(axis=2) / np.float32(127)).repeat(2, axis=1)
        assert np.array_equal(ds[:n, :, 0], d_ref)
        s_ref = d_ref * q_ref.reshape(n, k // 16, 16).astype(np.int64).sum(axis=2)
        np.testing.assert_allclose(ds[:n, :, 1], s_ref, rtol=1e-6, atol=1e-6)
        # with the residual plane: q unchanged, r and the sums of q + r / 254 as numpy makes them
        qs2, ds2, rs = (a.get() for a in launch.quantize_q8_1(cp.asarray(x), n_pad=n + 3, residual=True))
        r_ref, value = q16_ref(x)
        assert np.array_equal(qs2, qs) and np.array_equal(rs[:n], r_ref) and not rs[n:].any()
        assert np.abs(rs).max() <= 127 and (n == 1 or np.abs(rs).max() >= 100)   # (n = 1: the zero block only)
        ds2 = ds2.reshape(n + 3, k // 16, 2)
        assert np.array_equal(ds2[:n, :, 0], d_ref)
        np.testing.assert_allclose(ds2[:n, :, 1], value.reshape(n, k // 16, 16).sum(axis=2), rtol=1e-5, atol=1e-5)
        # 16-bit: within max|x| / 64,000 of x per 32 values, where q8_1 is within max|x| / 254
        amax = np.abs(x.reshape(n, k // 32, 32)).max(axis=2, keepdims=True)
        assert (np.abs(value - x).reshape(n, k // 32, 32) <= amax / 64000 + 1e-12).all()


@pytest.mark.parametrize("t", QTYPES, ids=lambda t: t.name)
def test_dequantize(t):
    """f32 against numpy; f16 equal to the f32 values rounded (every piece written: the output starts as NaN, and the
    shapes end in a warp's or a block's partial run of chunks); row gathers in both."""
    import cupy as cp
    from engine.cuda import launch
    rng = np.random.default_rng()
    for m, k in shapes(t):
        w, ref = random_weight(t, m, k, rng)
        out32 = launch.dequantize(w, "f32").get()
        np.testing.assert_allclose(out32, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
        out16 = launch.dequantize_into(w, cp.full((m, k), cp.nan, cp.float16)).get()
        np.testing.assert_array_equal(out16, out32.astype(np.float16))
        rows = rng.integers(0, m, 9)
        np.testing.assert_array_equal(launch.dequantize(w, "f32", rows=cp.asarray(rows)).get(), out32[rows])
        np.testing.assert_array_equal(launch.dequantize(w, "f16", rows=cp.asarray(rows)).get(), out16[rows])


@pytest.mark.parametrize("t", QTYPES, ids=lambda t: t.name)
def test_mul_mat_quantized(t):
    import cupy as cp
    from engine.cuda.dispatch import choose_path, mul_mat
    from engine.cuda.config import forced
    from engine.cuda.mmvq import mmvq_max_cols, takes_residual
    rng = np.random.default_rng()
    for m, k in shapes(t):
        w, wref = random_weight(t, m, k, rng)
        for n, exact in [(n, False) for n in NCOLS] + [(1, True)]:    # exact: 16-bit activations at one column
            x = rng.standard_normal((n, k)).astype(np.float32)
            _, xq = q8_1_ref(x)
            xd = cp.asarray(x)
            paths = [None, "mmq", "mmq_f16", "dequant"] + (["mmvq"] if n <= mmvq_max_cols(int(t)) else [])
            for path in paths:
                with forced(exact_decode=exact):
                    out = cp.full((n, m), cp.nan, cp.float32)
                    y = mul_mat(w, xd, path=path, out=out).get()
                    taken = path or choose_path(w, n)
                    ref = (mmvq_activations_ref(x, t) if taken == "mmvq" else xq) @ wref.T
                    if taken == "mmq_f16":
                        ref = f16(x) @ wref.T
                    label = f"{t.name} m={m} k={k} n={n} path={taken}"
                    assert np.isfinite(y).all(), f"{label}: unwritten outputs"
                    # dequant rounds weights and activations to f16; mmq_f16 the activations, and its weights come
                    # from f16 arithmetic (MMQ_F16_NMSE)
                    bound = {"dequant": 5e-4, "mmq_f16": MMQ_F16_NMSE}.get(taken, 1e-8)
                    assert nmse(y, ref) <= bound, f"{label}: nmse {nmse(y, ref):.3g}"
                    if taken == "mmvq" and takes_residual(int(t), n):     # 16-bit: near x itself (q8_1: ~1e-5)
                        assert nmse(y, x.astype(np.float64) @ wref.T) <= 1e-8, f"{label}: 16-bit activations"


@pytest.mark.parametrize("t,q4k", [(GGMLType.Q4_K, True), (GGMLType.Q4_K, False), (GGMLType.Q6_K, True),
                                   (GGMLType.Q8_0, True), (GGMLType.Q4_1, True)], ids=lambda v: getattr(v, "name", v))
def test_mmq_split_k(t, q4k):
    """MMQ (for Q4_K: mmq_q4_K on the raw blocks, or with CudaConfig.mmq_q4_K False the generic kernel) with k split
    over 1, 3 (uneven: 6 + 6 + 4 stages) and 16 blocks (one stage each), then the partials added in order: against
    numpy, against the unsplit kernel, and the same bits on a second run."""
    from engine.cuda.config import forced
    with forced(mmq_q4_K=q4k):
        mmq_split_k_cases(t, q4k)


def mmq_split_k_cases(t, q4k):
    import cupy as cp
    from engine.cuda import launch
    from engine.cuda import mmq as mmq_launch
    from engine.cuda.config import forced
    assert mmq_launch.mmq_kernel(int(t))[0] == ("mmq_q4_K" if q4k and t == GGMLType.Q4_K else f"mmq<{int(t)}>")
    rng = np.random.default_rng()
    m, k = 200, 4096
    w, rw = random_weight(t, m, k, rng)
    for n in (17, 64, 100):
        x = rng.standard_normal((n, k)).astype(np.float32)
        _, xq = q8_1_ref(x)
        qs, ds = launch.quantize_q8_1(cp.asarray(x), (n + 63) // 64 * 64)
        ys = {}
        for splits in (1, 3, 16):
            with forced(mmq_splits=splits):
                assert mmq_launch.mmq_splits(m, qs.shape[0], k, 132)[0] == splits
                y = mmq_launch.mmq(w, qs, ds, n, cp.full((n, m), cp.nan, cp.float32)).get()
                assert np.isfinite(y).all() and nmse(y, xq @ rw.T) <= 1e-8, (t.name, n, splits)
                assert np.array_equal(y, mmq_launch.mmq(w, qs, ds, n).get()), (t.name, n, splits, "run to run")
            ys[splits] = y
        assert nmse(ys[3], ys[1]) <= 1e-12 and nmse(ys[16], ys[1]) <= 1e-12, (t.name, n)


@pytest.mark.parametrize("small", [False, True], ids=["tiles", "small"])
@pytest.mark.parametrize("t", QTYPES, ids=lambda t: t.name)
def test_mmq_f16(t, small, monkeypatch):
    """mmq_f16 (raw blocks on f16 tensor cores: mmq_f16_small unpacking them in registers up to 64 columns of a large
    matrix, mmq_f16 to an f16 tile in shared memory otherwise; `small` lowers the size mmq_f16_small takes to these
    test matrices) at 1 to 4096 columns, partial row and column tiles, k split over 1, 3 and 16 blocks (then added in
    order): against numpy on f16-rounded activations and the exact weights (MMQ_F16_NMSE), every output written
    (NaN-poisoned), and the same bits on a second run."""
    import cupy as cp
    from engine.cuda import mmq_f16 as mmq_f16_launch
    from engine.cuda.config import forced
    from engine.cuda.mmq_f16 import mmq_f16
    rng = np.random.default_rng()
    m, k = (200, 4096) if TYPES[t].block_size == 256 else (200, 4064)     # 4064: a partial last stage
    w, wref = random_weight(t, m, k, rng)
    monkeypatch.setattr(mmq_f16_launch, "SMALL_MIN_WEIGHTS", m * k if small else 1 << 62)
    for n in (1, 3, 8, 9, 16, 17, 31, 33, 64, 100, 128, 512, 1000, 4096):
        assert mmq_f16_launch.takes_small(w, n) == (small and n <= mmq_f16_launch.SMALL_MAX_COLS)
        x = rng.standard_normal((n, k)).astype(np.float32)
        x16 = cp.asarray(x.astype(np.float16))
        ref = f16(x) @ wref.T
        for splits in ((1, 3, 16) if n in (3, 17, 33, 100, 1000) else (None,)):
            with forced(mmq_splits=splits):
                y = mmq_f16(w, x16, cp.full((n, m), cp.nan, cp.float32)).get()
                label = f"{t.name} n={n} splits={splits}"
                assert np.isfinite(y).all(), f"{label}: unwritten outputs"
                assert nmse(y, ref) <= MMQ_F16_NMSE, f"{label}: nmse {nmse(y, ref):.3g}"
                assert np.array_equal(y, mmq_f16(w, x16).get()), f"{label}: run to run"


@pytest.mark.parametrize("t", [GGMLType.F16, GGMLType.F32], ids=lambda t: t.name)
def test_mul_mat_float(t):
    import cupy as cp
    from engine.cuda.dispatch import mul_mat
    from engine.cuda.weights import upload
    rng = np.random.default_rng()
    for m, k in ((200, 600), (77, 301)):          # 16-byte rows (MMVF's vector loads) and not (plain loads)
        wf = rng.standard_normal((m, k)).astype(np.float16 if t == GGMLType.F16 else np.float32)
        w = upload(t, (m, k), wf.view(np.uint8))
        for n in NCOLS:
            x = rng.standard_normal((n, k)).astype(np.float32)
            xr = x.astype(np.float16).astype(np.float64) if t == GGMLType.F16 and n > 8 else x.astype(np.float64)
            ref = xr @ wf.astype(np.float64).T
            out = cp.full((n, m), cp.nan, cp.float32)
            y = mul_mat(w, cp.asarray(x), out=out).get()
            assert np.isfinite(y).all()
            assert nmse(y, ref) <= 1e-6, (m, k, n, nmse(y, ref))


@pytest.mark.parametrize("exact", [False, True], ids=["q8_1", "q16"])
@pytest.mark.parametrize("kernel", ["tc", "pieces", "pairs", "mmvq"])
def test_q4_K_mmvq_kernels_every_ncols(kernel, exact):
    """Q4_K through each of its MMVQ kernels (CudaConfig.mmvq_q4_K) at every column count it
    takes (9..16: the tensor-core kernel in one launch, the others in two; the tensor-core kernel also past 16, up
    to 64 columns, in kernels of 24..64 with fewer columns present), plain, three matrices in one launch and with
    the GLU epilogue, against numpy; exact: one column on 16-bit activations where the kernel has them."""
    from engine.cuda.config import forced
    with forced(mmvq_q4_K=kernel, mul_mat_path="mmvq", exact_decode=exact):   # mul_mats and glu too, past the
        q4_K_mmvq_cases(kernel, exact)                                      # dispatch table's n


def q4_K_mmvq_cases(kernel, exact):
    import cupy as cp
    from engine.cuda import dispatch
    from engine.cuda import mmvq as mmvq_launch
    ncols = range(1, mmvq_launch.PAIRS_MAX_COLS + 1) if kernel == "pairs" else range(1, 17)
    if kernel == "tc":
        ncols = [*ncols, 17, 23, 24, 31, 32, 40, 47, 56, 63, 64]
    if exact:
        ncols = [1]
    rng = np.random.default_rng()
    # k = 8192: one group of 128 threads per row; k = 256: one super-block per row (the tiny models' q/k/v, gate, up)
    for m, k in shapes(GGMLType.Q4_K) + [(37, 8192), (21, 256)]:
        (w, rw), (wk, rk), (wv, rv), (wu, ru) = (random_weight(GGMLType.Q4_K, rows, k, rng)
                                                 for rows in (m, m // 2 + 3, 21, m))
        for n in ncols:
            x = rng.standard_normal((n, k)).astype(np.float32)
            xq = mmvq_activations_ref(x, GGMLType.Q4_K)
            out = cp.full((n, m), cp.nan, cp.float32)
            y = dispatch.mul_mat(w, cp.asarray(x), path="mmvq", out=out).get()
            assert np.isfinite(y).all() and nmse(y, xq @ rw.T) <= 1e-8, (kernel, m, k, n)
            for o, r in zip(dispatch.mul_mats([w, wk, wv], cp.asarray(x)), (rw, rk, rv)):
                assert nmse(o.get(), xq @ r.T) <= 1e-8, (kernel, m, k, n, "q/k/v")
            gate, up = xq @ rw.T, xq @ ru.T
            y = dispatch.glu(w, wu, cp.asarray(x), "silu").get()
            assert nmse(y, gate / (1 + np.exp(-gate)) * up) <= 1e-8, (kernel, m, k, n, "glu")


def test_q4_K_mmvq_tc_every_split():
    """mmvq_tc_q4_K with k cut into 1..7 ranges (CudaConfig.mmvq_tc_splits; the last range's block adds the ranges'
    sums; at 8 columns the blocks of twice the warps; at 20 and 64 the kernels past 16 columns): against numpy, the
    same bits run to run, and its counters left at zero; plain, q/k/v and GLU."""
    import cupy as cp
    from engine.cuda import dispatch
    from engine.cuda import mmvq as mmvq_launch
    from engine.cuda.config import forced
    rng = np.random.default_rng()
    m, k = 300, 1792                                               # 3 row blocks of 128, 7 super-blocks per row
    (w, rw), (wk, rk), (wu, ru) = (random_weight(GGMLType.Q4_K, rows, k, rng) for rows in (m, 45, m))
    for n in (1, 6, 8, 13, 20, 64):
        x = rng.standard_normal((n, k)).astype(np.float32)
        _, xq = q8_1_ref(x)
        gate, up = xq @ rw.T, xq @ ru.T
        for splits in range(1, 8):
            with forced(mmvq_q4_K="tc", mul_mat_path="mmvq", mmvq_tc_splits=splits):
                y = dispatch.mul_mat(w, cp.asarray(x), path="mmvq", out=cp.full((n, m), cp.nan, cp.float32)).get()
                assert np.isfinite(y).all() and nmse(y, gate) <= 1e-8, (n, splits)
                assert np.array_equal(y, dispatch.mul_mat(w, cp.asarray(x), path="mmvq").get()), (n, splits)
                yq, yk = (o.get() for o in dispatch.mul_mats([w, wk], cp.asarray(x)))
                assert nmse(yq, gate) <= 1e-8 and nmse(yk, xq @ rk.T) <= 1e-8, (n, splits, "q/k")
                y = dispatch.glu(w, wu, cp.asarray(x), "gelu").get()
                ref = 0.5 * gate * (1 + np.tanh(0.7978845608028654 * (gate + 0.044715 * gate ** 3))) * up
                assert nmse(y, ref) <= 1e-8, (n, splits, "glu")
                assert not mmvq_launch._tc_scratch[-1][1].any(), (n, splits, "counters")


@pytest.mark.parametrize("exact", [False, True], ids=["q8_1", "q16"])
@pytest.mark.parametrize("rows", [1, 2])
def test_q6_K_mmvq_spans(rows, exact, monkeypatch):
    """mmvq_q6_K (one column) with 1 or 2 rows a warp, against numpy: rows of whole 8-block spans and of a short last
    span, rows whose starts are not 16-byte aligned, a row count not a multiple of the rows a block serves, and three
    matrices in one launch."""
    import cupy as cp
    from engine.cuda import dispatch
    from engine.cuda import mmvq as mmvq_launch
    from engine.cuda.config import forced
    monkeypatch.setattr(mmvq_launch, "Q6_K_ROWS", rows)
    monkeypatch.setattr(mmvq_launch, "Q6_K_MIN_ROWS", 1)      # small matrices take it too
    rng = np.random.default_rng()
    t = GGMLType.Q6_K
    with forced(exact_decode=exact):
        for m, k in [(130, 2048), (9, 4352), (67, 14336), (3, 256)]:
            assert mmvq_launch.mmvq_choice(int(t), 1, 0, m * k, k, exact)[0] == f"mmvq_q6_K<{rows}, {int(exact)}>"
            x = rng.standard_normal((1, k)).astype(np.float32)
            xq = mmvq_activations_ref(x, t)
            (w, ref), (w2, ref2), (w3, ref3) = (random_weight(t, rows_, k, rng) for rows_ in (m, m // 2 + 1, 5))
            out = cp.full((1, m), cp.nan, cp.float32)
            y = dispatch.mul_mat(w, cp.asarray(x), path="mmvq", out=out).get()
            assert np.isfinite(y).all() and nmse(y, xq @ ref.T) <= 1e-8, (m, k, nmse(y, xq @ ref.T))
            for o, r in zip(dispatch.mul_mats([w, w2, w3], cp.asarray(x)), (ref, ref2, ref3)):
                assert nmse(o.get(), xq @ r.T) <= 1e-8, (m, k, "three matrices")


@pytest.mark.parametrize("t", QTYPES, ids=lambda t: t.name)
def test_mmvq_multi_and_glu(t):
    """Three matrices in one MMVQ launch (q, k, v: different row counts), and the fused gate/up GLU, against numpy
    (at one column also on 16-bit activations)."""
    import cupy as cp
    from engine.cuda import dispatch
    from engine.cuda.config import forced
    rng = np.random.default_rng()
    m, k = shapes(t)[0]
    (wq, rq), (wk, rk), (wv, rv) = (random_weight(t, rows, k, rng) for rows in (m, m // 2 + 3, 37))
    (wg, rg), (wu, ru) = (random_weight(t, m, k, rng) for _ in range(2))
    for n, exact in [(1, False), (2, False), (3, False), (8, False), (11, False), (16, False), (1, True)]:
        with forced(exact_decode=exact):
            x = rng.standard_normal((n, k)).astype(np.float32)
            xq = mmvq_activations_ref(x, t)
            outs = dispatch.mul_mats([wq, wk, wv], cp.asarray(x))
            for out, ref in zip(outs, (xq @ rq.T, xq @ rk.T, xq @ rv.T)):
                assert out.shape == ref.shape and nmse(out.get(), ref) <= 1e-8, (t.name, n)
            g, u = xq @ rg.T, xq @ ru.T
            for act, ref in (("silu", g / (1 + np.exp(-g)) * u),
                             ("gelu", 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3))) * u)):
                y = dispatch.glu(wg, wu, cp.asarray(x), act).get()
                assert nmse(y, ref) <= 1e-8, (t.name, n, act, nmse(y, ref))


@pytest.mark.parametrize("t", [GGMLType.Q8_0, GGMLType.Q4_K], ids=lambda t: t.name)
def test_nvrtc_fallback_equals_prebuilt(t):
    """A GPU without a prebuilt binary compiles the kernels with NVRTC (one group at a time): the same source gives
    the prebuilt cubin's bits, for a plain kernel (rms_norm) and a templated one (dequantize_f32<T>)."""
    import cupy as cp
    from engine.backends.cuda import norm_threads, norm_values
    from engine.cuda import build
    if build._prebuilt("dequantize") is None or build._prebuilt("rms_norm") is None:
        pytest.skip("no prebuilt kernels for this GPU in this install")
    rng = np.random.default_rng()
    w, ref = random_weight(t, 37, 512, rng)
    outs = []
    for get in (build._prebuilt("dequantize").get_function,
                build._nvrtc_group("dequantize", f"dequantize_f32<{int(t)}").get_function):
        out = cp.full((37, 512), cp.nan, cp.float32)
        get(f"dequantize_f32<{int(t)}>")((((37 * 16) + 255) // 256,), (256,),
                                         (w.data, np.uint64(0), out, np.int32(37), np.int32(512), np.int64(w.row_bytes)))
        outs.append(out.get())
    assert np.array_equal(outs[0], outs[1]) and np.allclose(outs[0], ref, rtol=1e-6, atol=1e-6)
    x = cp.asarray(rng.standard_normal((5, 576)).astype(np.float32))
    g = cp.asarray(rng.standard_normal(576).astype(np.float32))
    ys = []
    name = f"rms_norm<{norm_values(576)}>"
    for mod in (build._prebuilt("rms_norm"), build._nvrtc_group("rms_norm", name[:-1])):
        y = cp.full((5, 576), cp.nan, cp.float32)
        mod.get_function(name)((5,), (norm_threads(576),), (x, g, y, np.int32(576), np.float32(1e-6)))
        ys.append(y.get())
    assert np.array_equal(ys[0], ys[1]) and np.isfinite(ys[0]).all()
