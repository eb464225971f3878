"""The mul_mat dispatch table (no GPU needed: the choice is made from the weight's type and shape)."""
import pytest

from engine.cuda.config import CudaConfig, forced
from engine.cuda.dispatch import Activations, choose_path, resolve_path
from engine.cuda.weights import GPUWeight
from engine.quants import GGMLType

SM90 = (9, 0)


def weight(t, m, k):
    return GPUWeight(t, m, k, None, 0)


def test_sm90_table():
    """Matrices of fewer than mmq_f16.SMALL_MIN_WEIGHTS weights take THRESHOLDS, larger ones THRESHOLDS_LARGE (where
    mmq_f16 runs mmq_f16_small up to 64 columns)."""
    from engine.cuda.mmq_f16 import SMALL_MIN_WEIGHTS
    small, large = weight(GGMLType.Q4_K, 576, 1536), weight(GGMLType.Q4_K, 4096, 14336)
    assert 576 * 1536 < SMALL_MIN_WEIGHTS <= 4096 * 4096 <= 4096 * 14336
    # small Q4_K: mmvq_tc_q4_K up to 48 columns, mmq_q4_K to 64, mmq_f16 to 256; Q6_K: MMQ to 64, mmq_f16 to 128
    assert [choose_path(small, n, SM90) for n in (1, 16, 17, 48, 49, 64, 65, 256, 257)] == \
        ["mmvq"] * 4 + ["mmq"] * 2 + ["mmq_f16"] * 2 + ["dequant"]
    assert [choose_path(weight(GGMLType.Q6_K, 576, 1536), n, SM90) for n in (16, 17, 64, 65, 128, 129)] == \
        ["mmvq"] + ["mmq"] * 2 + ["mmq_f16"] * 2 + ["dequant"]
    for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_1, GGMLType.Q5_K, GGMLType.IQ4_NL, GGMLType.IQ4_XS):
        assert [choose_path(weight(t, 576, 1536), n, SM90) for n in (16, 17, 256, 257)] == \
            ["mmvq"] + ["mmq_f16"] * 2 + ["dequant"]
    # large Q4_K: MMVQ up to 16 columns, mmq_f16 to 128; Q6_K: MMVQ to 4, mmq_f16 to 128; no MMQ
    assert [choose_path(large, n, SM90) for n in (1, 16, 17, 64, 128, 129)] == \
        ["mmvq"] * 2 + ["mmq_f16"] * 3 + ["dequant"]
    assert [choose_path(weight(GGMLType.Q6_K, 4096, 4096), n, SM90) for n in (4, 5, 64, 128, 129)] == \
        ["mmvq"] + ["mmq_f16"] * 3 + ["dequant"]
    for t in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q5_K, GGMLType.IQ4_NL):
        assert [choose_path(weight(t, 4096, 14336), n, SM90) for n in (4, 5, 256, 257)] == \
            ["mmvq"] + ["mmq_f16"] * 2 + ["dequant"]
    for t in (GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.IQ4_XS):
        assert [choose_path(weight(t, 4096, 14336), n, SM90) for n in (9, 128, 129)] == ["mmq_f16"] * 2 + ["dequant"]
    assert choose_path(small, 512, SM90) == "dequant"
    assert choose_path(weight(GGMLType.IQ4_XS, 64, 256), 1, SM90) == "mmvq"
    f16 = weight(GGMLType.F16, 4096, 4096)
    assert choose_path(f16, 8, SM90) == "mmvf" and choose_path(f16, 9, SM90) == "cublas"
    assert choose_path(large, 16, (8, 9)) == "mmvq" and choose_path(large, 17, (8, 9)) == "dequant"   # not measured


def test_mmq_f16_small_takes_large_matrices():
    """mmq_f16 runs mmq_f16_small up to 64 columns of a matrix of at least SMALL_MIN_WEIGHTS weights, else its tiles."""
    from engine.cuda.mmq_f16 import SMALL_MIN_WEIGHTS, takes_small
    big, small = weight(GGMLType.Q4_K, 4096, 4096), weight(GGMLType.Q4_K, 576, 1536)
    assert 576 * 1536 < SMALL_MIN_WEIGHTS <= 4096 * 4096
    assert takes_small(big, 1) and takes_small(big, 64) and not takes_small(big, 65)
    assert not takes_small(small, 1) and not takes_small(small, 64)


def test_forced_paths():
    w = weight(GGMLType.Q8_0, 4096, 4096)
    with forced(mul_mat_path="mmq"):
        assert resolve_path(w, 3) == "mmq"
        assert resolve_path(weight(GGMLType.F32, 64, 64), 3) == "mmvf"     # float weights have no q8_1 path
    with forced(mul_mat_path="mmvq"):
        assert resolve_path(w, 16) == "mmvq"
        with pytest.raises(ValueError, match="at most 16"):
            resolve_path(w, 17)
        assert resolve_path(weight(GGMLType.Q4_K, 4096, 4096), 64) == "mmvq"      # Q4_K's tensor-core kernel
        with pytest.raises(ValueError, match="at most 64"):
            resolve_path(weight(GGMLType.Q4_K, 4096, 4096), 65)
    with pytest.raises(ValueError, match="unknown mul_mat path"):
        resolve_path(w, 3, "bogus")
    with pytest.raises(ValueError, match="unknown mul_mat path"):
        CudaConfig(mul_mat_path="bogus")
    with pytest.raises(ValueError, match="unknown Q4_K MMVQ kernel"):
        CudaConfig(mmvq_q4_K="mma")


def test_mmq_f16_refused_off_sm90(monkeypatch):
    """A forced mmq_f16 on an architecture it is not built for is a clear error, not a failed launch."""
    from engine.cuda import dispatch
    w = weight(GGMLType.Q4_K, 4096, 4096)
    monkeypatch.setattr(dispatch, "_arch", lambda: (8, 6))
    with pytest.raises(ValueError, match="mmq_f16 path runs on sm_90 only"):
        resolve_path(w, 20, "mmq_f16")
    monkeypatch.setattr(dispatch, "_arch", lambda: (9, 0))
    assert resolve_path(w, 20, "mmq_f16") == "mmq_f16"


def test_activation_forms_follow_the_last_array():
    """A kernel's q8_1 output is reused for the same array only; another array starts afresh."""
    acts, x, y = Activations(), object(), object()
    acts.put_q8_1(x, ("qs", "ds"))
    assert acts.q8_1(x) == ("qs", "ds")
    acts.put_q8_1(y, ("qs2", "ds2"))
    assert acts.forms == {("q8_1", None): ("qs2", "ds2")} and acts.x is y
    acts.put_q8_1(y, ("qs3", "ds3", "rs3"))                       # with its residual plane: that form only
    assert acts.q8_1_residual(y) == ("qs3", "ds3", "rs3") and acts.forms[("q8_1", None)] == ("qs2", "ds2")
    acts.clear()
    assert acts.x is None and acts.forms == {}


def test_residual_plane_at_one_column_only():
    """CudaConfig.exact_decode: one-column MMVQ on mmvq / mmvq_q4_K_pairs takes the residual plane (EXACT
    instances); more columns, the tensor-core and piece kernels, or exact_decode off do not."""
    from engine.cuda.config import CudaConfig
    from engine.cuda.dispatch import residual_rows
    assert CudaConfig().exact_decode is False
    from engine.cuda.mmvq import mmvq_choice, takes_residual
    q4k, q6k = int(GGMLType.Q4_K), int(GGMLType.Q6_K)
    assert not takes_residual(q4k, 1) and not takes_residual(q6k, 1) and not residual_rows(1)   # off by default
    with forced(exact_decode=True):
        assert takes_residual(q4k, 1) and takes_residual(q6k, 1) and residual_rows(1)
        assert not takes_residual(q4k, 2) and not takes_residual(q6k, 2) and not residual_rows(2)
        for kernel in ("tc", "pieces"):
            with forced(mmvq_q4_K=kernel):
                assert not takes_residual(q4k, 1) and takes_residual(q6k, 1)
    assert mmvq_choice(q4k, 1, 0, exact=True)[:2] == ("mmvq_q4_K_pairs<1, 0, 1>", 4)     # 4 rows per group
    out_rows = 128256 * 4096           # an output matrix's launch
    assert mmvq_choice(q6k, 1, 0, out_rows, 4096, exact=True)[:2] == ("mmvq_q6_K<2, 1>", 2)    # 2 rows per warp
    assert mmvq_choice(q6k, 1, 2, exact=True)[0] == "mmvq<14, 1, 2, 1>"              # GLU: the generic kernel


def test_mmvq_kernel_choice():
    """Q4_K takes mmvq_q4_K_pairs at one column, mmvq at 2-4 and mmvq_pieces at 5-8, mmvq_tc_q4_K at 9-64 and from 3
    columns for large matrices (2 for long rows); CudaConfig.mmvq_q4_K forces one of them. Q6_K takes mmvq_q6_K at
    one column (without GLU) in launches of 8,192 rows or more, mmvq otherwise."""
    from engine.cuda.mmvq import mmvq_choice
    q4k, q6k = int(GGMLType.Q4_K), int(GGMLType.Q6_K)
    assert [mmvq_choice(q4k, n, 0)[0].split("<")[0] for n in range(1, 9)] == (
        ["mmvq_q4_K_pairs"] + ["mmvq"] * 3 + ["mmvq_pieces"] * 4)
    assert mmvq_choice(q4k, 1, 0)[:2] == ("mmvq_q4_K_pairs<1, 0, 0>", 2)     # two rows per group
    assert mmvq_choice(q4k, 1, 1)[:2] == ("mmvq_q4_K_pairs<1, 1, 0>", 1)     # GLU: a gate row and an up row
    big = 4096 * 14336
    assert [mmvq_choice(q4k, n, 0, big)[0].split("<")[0] for n in range(1, 17)] == (
        ["mmvq_q4_K_pairs"] + ["mmvq"] + ["mmvq_tc_q4_K"] * 14)
    assert [mmvq_choice(q4k, n, 0, 4096 * 4096)[0].split("<")[0] for n in (3, 4, 8, 9, 16)] == (
        ["mmvq", "mmvq", "mmvq_pieces", "mmvq_tc_q4_K", "mmvq_tc_q4_K"])
    # at 2 columns where k >= 2 x the rows (4096 x 14336), not 14336 x 4096 or a 4096 x 4096 launch
    assert mmvq_choice(q4k, 2, 0, big, 14336)[0] == "mmvq_tc_q4_K<2, 0>"
    assert mmvq_choice(q4k, 2, 0, big, 4096)[0] == mmvq_choice(q4k, 2, 0, 4096 * 4096, 4096)[0] == "mmvq<12, 2, 0, 0>"
    assert mmvq_choice(q4k, 1, 0, big, 14336)[0] == "mmvq_q4_K_pairs<1, 0, 0>"
    assert mmvq_choice(q6k, 8, 0, big)[0] == "mmvq<14, 8, 0, 0>"
    assert all(mmvq_choice(q6k, n, 0)[0].startswith("mmvq<") for n in range(2, 9))
    assert mmvq_choice(q6k, 1, 0, big, 14336)[0] == "mmvq<14, 1, 0, 0>"          # 4,096 rows
    assert mmvq_choice(q6k, 1, 0, big, 4096)[:2] == ("mmvq_q6_K<2, 0>", 2)           # 14,336 rows
    assert mmvq_choice(q6k, 1, 1)[0] == "mmvq<14, 1, 1, 0>"
    assert mmvq_choice(q4k, 8, 1)[:2] == ("mmvq_pieces<12, 8, 1>", 2)       # GLU: half the rows of the group
    assert mmvq_choice(q4k, 20, 0)[0] == "mmvq_tc_q4_K<24, 0>"              # past 16: the next wide kernel
    with forced(mmvq_q4_K="mmvq"):
        assert mmvq_choice(q4k, 1, 0)[0] == "mmvq<12, 1, 0, 0>" and mmvq_choice(q4k, 8, 0, big)[0] == "mmvq<12, 8, 0, 0>"
    with forced(mmvq_q4_K="pieces"):
        assert mmvq_choice(q4k, 1, 0)[0] == "mmvq_pieces<12, 1, 0>" and mmvq_choice(q4k, 8, 0, big)[0] == \
            "mmvq_pieces<12, 8, 0>"
    with forced(mmvq_q4_K="pairs"):
        assert mmvq_choice(q4k, 1, 0)[0] == "mmvq_q4_K_pairs<1, 0, 0>" and mmvq_choice(q4k, 5, 0)[0] == "mmvq<12, 5, 0, 0>"
    with forced(mmvq_q4_K="tc"):
        assert mmvq_choice(q4k, 5, 0)[:2] == ("mmvq_tc_q4_K<5, 0>", 128)      # 8 warps of 16 rows
        assert mmvq_choice(q4k, 5, 2)[:2] == ("mmvq_tc_q4_K<5, 2>", 64)       # GLU: gate and up tiles
        assert mmvq_choice(q6k, 3, 0)[0] == "mmvq<14, 3, 0, 0>"


def test_mmvqt_splits(monkeypatch):
    """mmvq_tc_q4_K's k ranges: about two blocks per SM (one where its blocks are twice as wide), at most
    MMVQT_MAX_RANGE super-blocks each, none empty."""
    from engine.cuda import launch
    from engine.cuda import mmvq as mmvq_launch
    monkeypatch.setattr(launch, "_sm_count", lambda: 132)
    assert mmvq_launch.mmvqt_splits(32, 14336, 1) == 8         # 4096 x 14336: 32 row blocks x 8 ranges of 7
    assert mmvq_launch.mmvqt_splits(224, 4096, 1) == 1         # gate/up GLU of 14336 rows: one range of 16
    assert mmvq_launch.mmvqt_splits(2, 1792, 1) == 7           # capped by the 7 super-blocks
    assert mmvq_launch.mmvqt_splits(1000, 8192, 1) == 2        # at most 16 super-blocks per range
    assert mmvq_launch.mmvqt_splits(32, 14336 - 256, 1) == 8 and mmvq_launch.mmvqt_splits(44, 2560, 1) == 5   # ranges of 7, 2
    assert mmvq_launch.mmvqt_rows(0, 8) == 256 and mmvq_launch.mmvqt_rows(1, 6) == 128 and mmvq_launch.mmvqt_rows(0, 5) == 128
    assert mmvq_launch.mmvqt_splits(16, 14336, 8) == 8         # 8 columns: 16 row blocks of 256, one block per SM
    assert [mmvq_launch.mmvqt_sums_cols(n) for n in (1, 2, 3, 5, 7, 8, 13)] == [1, 2, 4, 8, 8, 8, 16]   # past 2: to 4
    for rb in (1, 7, 32, 100, 300):
        for k in (256, 1792, 4096, 14336, 28672):
            s = mmvq_launch.mmvqt_splits(rb, k, 1)
            per = -(-k // 256 // s)
            assert 1 <= s <= k // 256 and per <= mmvq_launch.MMVQT_MAX_RANGE and (s - 1) * per < k // 256, (rb, k)
    with forced(mmvq_tc_splits=5):
        assert mmvq_launch.mmvqt_splits(32, 14336, 1) == 5
    with forced(mmvq_tc_splits=1):
        assert mmvq_launch.mmvqt_splits(32, 14336, 1) == 4         # 56 super-blocks: at least 4 ranges of <= 16


def test_mmq_split_rule():
    """MMQ splits k only where its tiles are fewer than the SMs, into equal non-empty runs of stages (256 values)."""
    from engine.cuda.mmq import mmq_splits
    assert mmq_splits(4096, 512, 14336, 132) == (1, 56)          # 256 tiles: no split
    assert mmq_splits(4096, 64, 14336, 132) == (4, 14)           # 32 tiles x 4 splits = 128 blocks
    assert mmq_splits(200, 64, 4096, 132) == (8, 2)              # at most MMQ_MAX_SPLITS
    assert mmq_splits(77, 64, 512, 132) == (2, 1)                # no more splits than stages
    with forced(mmq_splits=3):
        assert mmq_splits(200, 64, 4096, 132) == (3, 6)          # 16 stages: 6 + 6 + 4
    with forced(mmq_splits=1):
        assert mmq_splits(200, 64, 4096, 132) == (1, 16)


def test_mmq_f16_launch_rule():
    """mmq_f16_small takes up to 64 columns in the fewest of 1, 2, 4 or 8 B tiles of 8; mmq_f16 64-column tiles up to
    64 columns, 128 above; both split k where their tiles are fewer than the block slots."""
    from engine.cuda.mmq import mmq_splits
    from engine.cuda.mmq_f16 import MF_BM, MF_KT, MFS_KT, SMALL_MAX_COLS, column_tile, small_tiles
    assert SMALL_MAX_COLS == 64
    assert [small_tiles(n) for n in (1, 8, 9, 16, 17, 32, 33, 64)] == [1, 1, 2, 2, 4, 4, 8, 8]
    assert mmq_splits(4096, 32, 14336, 132, (MF_BM, 32, MFS_KT)) == (4, 14)     # 32 tiles x 4 splits of 14 stages
    assert mmq_splits(14336, 16, 4096, 264, (MF_BM, 16, MFS_KT)) == (2, 8)      # two blocks an SM at <= 16 columns
    assert [column_tile(n) for n in (1, 17, 64, 65, 128, 4096)] == [64, 64, 64, 128, 128, 128]
    assert mmq_splits(4096, 64, 14336, 132, (MF_BM, 64, MF_KT)) == (4, 28)      # 32 tiles x 4 splits of 28 stages
    assert mmq_splits(4096, 512, 14336, 132, (MF_BM, 128, MF_KT)) == (1, 112)   # 128 tiles: no split
    assert mmq_splits(14336, 100, 4096, 132, (MF_BM, 128, MF_KT)) == (1, 32)


def test_mmq_kernel_choice():
    """Q4_K takes mmq_q4_K (raw blocks in shared memory, sized for 2 blocks per SM) unless CudaConfig.mmq_q4_K is
    False."""
    from engine.cuda.mmq import MMQ_SMEM_BYTES, MMQK_SMEM_BYTES, mmq_kernel
    assert mmq_kernel(int(GGMLType.Q4_K)) == ("mmq_q4_K", MMQK_SMEM_BYTES, 2)
    assert 2 * (MMQK_SMEM_BYTES + 1024) <= 228 * 1024                     # sm_90: 228 KB of shared memory per SM
    assert mmq_kernel(int(GGMLType.Q6_K)) == ("mmq<14>", MMQ_SMEM_BYTES, 1)
    with forced(mmq_q4_K=False):
        assert mmq_kernel(int(GGMLType.Q4_K)) == ("mmq<12>", MMQ_SMEM_BYTES, 1)


def test_mmvq_group_rules():
    """The row-group splits measured fastest on the H200 (BENCHMARKS.md)."""
    from engine.cuda.mmvq import _mmvq_groups, _mmvqp_groups
    q4k, q6k, q4_1 = int(GGMLType.Q4_K), int(GGMLType.Q6_K), int(GGMLType.Q4_1)
    # q4_K, the synthetic 8B's and 1B's matrices: (m, k) -> groups
    for (m, k), g in {(4096, 4096): 4, (14336, 4096): 4, (4096, 14336): 4, (1024, 4096): 1, (2048, 2048): 2,
                      (512, 2048): 2, (8192, 2048): 4, (2048, 8192): 2}.items():
        assert _mmvq_groups(q4k, m, k) == g, (m, k)
    assert _mmvq_groups(q4k, 4096 + 2 * 1024, 4096) == 4          # a q/k/v launch counts all its rows
    assert _mmvq_groups(q6k, 4096, 14336) == 1                    # other types: by k only
    assert _mmvq_groups(q4_1, 576, 576) == 4 and _mmvq_groups(q4_1, 1536, 576) == 4
    for (m, k), g in {(4096, 4096): 2, (14336, 4096): 4, (4096, 14336): 2, (1024, 4096): 1, (2048, 2048): 1,
                      (8192, 2048): 4, (2048, 8192): 1, (640, 640): 4}.items():
        assert _mmvqp_groups(q4k, m, k) == g, (m, k)


def test_mmvq_args_layout():
    """The MMVQ kernels' argument tuple (kernels/mmvq.cu MMVQ_PARAMS): absent matrices are null with 0 rows."""
    from engine.cuda.mmvq import mmvq_args
    q, v = GPUWeight(GGMLType.Q4_K, 4096, 2048, "wq", 1152), GPUWeight(GGMLType.Q4_K, 1024, 2048, "wv", 1152)
    args = mmvq_args([q, v], "qs", "ds", None, ["yq", "yv"], 4)
    assert args[:9] == ("wq", "wv", 0, "qs", "ds", 0, "yq", "yv", 0)
    assert [int(a) for a in args[9:]] == [4096, 1024, 0, 2048, 1152, 4]
    assert mmvq_args([q], "qs", "ds", "rs", ["yq"], 4)[5] == "rs"          # the residual plane (EXACT instances)


def test_mmvq_column_groups():
    """9..64 columns: one tensor-core launch for Q4_K, launches of <= 8 columns for the other types."""
    from engine.cuda.mmvq import column_groups
    q4k, q6k = int(GGMLType.Q4_K), int(GGMLType.Q6_K)
    assert column_groups(q4k, 8) == [(0, 8)] and column_groups(q6k, 8) == [(0, 8)]
    assert column_groups(q4k, 12) == [(0, 12)] and column_groups(q6k, 12) == [(0, 8), (8, 4)]
    assert column_groups(q6k, 16) == [(0, 8), (8, 8)]
    assert column_groups(q4k, 40) == [(0, 40)]
    with forced(mmvq_q4_K="pieces"):
        assert column_groups(q4k, 9) == [(0, 8), (8, 1)]
    with pytest.raises(ValueError, match="1..16 columns"):
        column_groups(q6k, 17)


def test_mmvqt_scratch_from_default_pool(monkeypatch):
    """mmvq_tc_q4_K's scratch comes from CuPy's default pool (not a graph's private one), grows when a launch needs
    more, and keeps the older buffers (captured graphs hold their addresses)."""
    from engine.cuda import launch
    from engine.cuda import mmvq as mmvq_launch

    class Pool:
        def __init__(self):
            self.sizes = []

        def malloc(self, nbytes):
            self.sizes.append(nbytes)
            return f"ptr{len(self.sizes)}"

    class Array:
        def __init__(self, shape, dtype, memptr):
            self.size, self.memptr, self.filled = shape[0], memptr, None

        def fill(self, v):
            self.filled = v

    pool = Pool()
    fake = type("cp", (), {"get_default_memory_pool": staticmethod(lambda: pool), "ndarray": Array,
                           "float32": "f4", "int32": "i4"})
    monkeypatch.setattr(launch, "_cp", lambda: fake)
    monkeypatch.setattr(mmvq_launch, "_tc_scratch", [])
    part, counters = mmvq_launch._mmvqt_scratch(1000, 10)
    assert part.size == 1 << 20 and counters.size == 1 << 14 and counters.filled == 0
    assert mmvq_launch._mmvqt_scratch(5000, 20) == (part, counters)            # fits: the same buffers
    part2, _ = mmvq_launch._mmvqt_scratch(3 << 20, 20)
    assert part2.size == 3 << 20 and len(mmvq_launch._tc_scratch) == 2 and mmvq_launch._tc_scratch[0][0] is part
    assert pool.sizes == [4 << 14, 4 << 20, 4 << 14, 12 << 20]


def test_batch_invariant_paths():
    """Batch-invariant mode: one kernel family per weight whatever the column count (MMVQ's generic kernel in launches
    of 8, MMVF for float weights and types without MMVQ), so a column's sums do not depend on the others."""
    from engine.cuda import mmvq
    types = (GGMLType.Q4_K, GGMLType.Q4_1, GGMLType.Q6_K, GGMLType.Q8_0, GGMLType.IQ4_XS)
    with forced(batch_invariant=True):
        for t in types:
            w = weight(t, 4096, 14336)
            assert {choose_path(w, n, SM90) for n in (1, 2, 8, 9, 17, 33, 64, 129, 512, 4096)} == {"mmvq"}
            for n in (1, 5, 8, 9, 32, 64, 513):
                name, *_ = mmvq.mmvq_choice(int(t), n if n <= 8 else 8, 0, 4096 * 14336, 14336)
                assert name.startswith("mmvq<"), (t, n, name)
                assert mmvq.column_groups(int(t), n) == [(j, min(8, n - j)) for j in range(0, n, 8)]
            assert not mmvq.takes_residual(int(t), 1)
        for t in (GGMLType.F16, GGMLType.F32, GGMLType.BF16):
            assert {choose_path(weight(t, 4096, 4096), n, SM90) for n in (1, 8, 9, 512)} == {"mmvf"}
    assert choose_path(weight(GGMLType.Q4_K, 4096, 14336), 1, SM90) == "mmvq"
    assert mmvq.mmvq_choice(int(GGMLType.Q4_K), 1, 0, 4096 * 14336, 14336)[0].startswith("mmvq_q4_K_pairs")
    assert mmvq.mmvq_choice(int(GGMLType.Q6_K), 1, 0, 14336 * 4096, 4096)[0].startswith("mmvq_q6_K")


def test_batch_invariance_refuses_forced_kernels():
    for fields in ({"mul_mat_path": "mmq"}, {"mmvq_q4_K": "tc"}, {"exact_decode": True}):
        with pytest.raises(ValueError, match="--batch-invariant"):
            CudaConfig(batch_invariant=True, **fields)
