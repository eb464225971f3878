"""The kernels built ahead of time (engine/cuda/aot.py, run by `pip install`): every family's cubin for every
architecture, each with every kernel's symbol; the launch rules read the kernels' own constants. No GPU needed."""
import json

import numpy as np
import pytest

from engine.cuda import aot, build
from engine.quants import GGMLType

NVCC = aot.find_nvcc()


def test_type_list_is_the_ggml_numbering():
    """common.cuh's T_<type> numbers (build.QTYPES, read from it) are GGUF's type numbers."""
    assert len(build.QTYPES) == 12
    for name, value in build.QTYPES.items():
        assert int(GGMLType[name[2:]]) == value


def test_canonical_names_match_demangled_symbols():
    """A name expression and the demangled symbol of its kernel compare equal (typedefs spelled out)."""
    assert build.canonical_name("void kv_store<unsigned short>(float const*, unsigned short*)") == \
        build.canonical_name("kv_store<u16>")
    assert build.canonical_name("quantize_q8_1(float const*, signed char*)") == "quantize_q8_1"
    assert build.canonical_name("void mmvq<12, 8, 0>(unsigned char const*)") == build.canonical_name("mmvq<12, 8, 0>")


def test_groups_split_families_by_kernel_and_first_argument():
    assert build.group_of("mmvq<12, 8, 0>") == "mmvq<12"
    assert build.group_of("attention_decode<u16, 128, 4, false>") == "attention_decode<u16"
    assert build.group_of("mmq_split_sum") == "mmq_split_sum"
    assert build.group_of("dequantize_f16<14>") == "dequantize_f16<14"


def test_prebuilt_arch_takes_same_major_below():
    built = ["sm_80", "sm_86", "sm_90"]
    assert build.prebuilt_arch("sm_90", built) == "sm_90"
    assert build.prebuilt_arch("sm_89", built) == "sm_86"        # CUDA runs sm_86 code on sm_89
    assert build.prebuilt_arch("sm_87", ["sm_80"]) == "sm_80"
    assert build.prebuilt_arch("sm_120", built) is None          # no binary: NVRTC
    assert build.prebuilt_arch("sm_75", built) is None


def test_no_kernel_source_instantiates_or_reads_the_environment():
    """The kernel list lives in build.name_expressions only, and no kernel is chosen by an environment variable."""
    import re
    from pathlib import Path
    for path in build.KERNEL_DIR.iterdir():
        text = path.read_text()
        assert "template __global__" not in text, path.name
        assert "#ifndef" not in text and "#ifdef" not in text, f"{path.name}: a compile-time switch"
    for path in (Path(build.__file__).parent).glob("*.py"):
        assert not re.search(r"environ\.get\(\"ENGINE_", path.read_text()), path.name
    backends = Path(build.__file__).parent.parent / "backends"
    for path in backends.glob("*.py"):
        assert "ENGINE_" not in path.read_text(), path.name


def test_launch_rules_read_the_kernels_constants():
    """launch.py's tile and shared-memory sizes are the kernels' own #defines (no copies), and its mmvq_tc_q4_K
    shared-memory rule adds up the kernel's layout."""
    from engine.cuda import mmvq as mmvq_launch
    from engine.cuda import mmq as mmq_launch
    c, v = build.constants("mmq"), build.constants("mmvq")
    assert (mmq_launch.MMQ_BM, mmq_launch.MMQ_BN, mmq_launch.MMQ_KT) == (c["MMQ_BM"], c["MMQ_BN"], c["MMQ_KT"])
    assert mmq_launch.MMQ_SMEM_BYTES == c["MMQ_SMEM_BYTES"] and mmq_launch.MMQK_SMEM_BYTES == c["MMQK_SMEM_BYTES"]
    acts_and_sums = 8 * 8 * (32 + 8) + v["MMVQT_WARPS"] * 16 * 4     # k = 256, one column: 8 chunks x 8 B columns
    assert mmvq_launch.mmvqt_smem_bytes(256, 1, 1) == acts_and_sums + v["MMVQT_WARPS"] * 16 * v["MMVQT_WIN_LD"]
    wide = 2 * v["MMVQT_WARPS"]                                     # 8 columns: twice the warps
    assert mmvq_launch.mmvqt_warps(8) == wide and mmvq_launch.mmvqt_warps(v["MMVQT_WIDE_FROM"] - 1) == v["MMVQT_WARPS"]
    assert [mmvq_launch.mmvq_rows(n) for n in (1, 2, 8)] == [v["MMVQ_ROWS_1"], v["MMVQ_ROWS_N"], v["MMVQ_ROWS_N"]]
    from engine.cuda import mmq_f16
    f = build.constants("mmq_f16")
    for bn in build.MMQ_F16_BN:                  # the f16 weight tile, then per stage raw blocks and bn columns
        stages = f[f"MF_STAGES_{bn}"]
        layout = f["MF_BM"] * f["MF_LD"] * 2 + stages * (f["MF_BM"] * f["MF_RAW_LD"] + bn * f["MF_LD"] * 2)
        assert mmq_f16.SMEM_BYTES[bn] == layout <= 227 * 1024, bn               # sm_90's most for one block
    assert f["MFS_XCOL"] == 256 * 2              # mmq_f16_small: a column's 256 f16 activations a stage, unpadded
    for t in build.QTYPES.values():              # mmq_f16_small: per stage 128 rows' raw units, then the activations
        qk, nbytes = build.QTRAITS[t]
        unit = nbytes * max(qk, 256) // qk                           # bytes of a stage's 256 values
        for nb in build.MMQ_F16_SMALL_NB:
            stages, stage, per_sm = build.mmq_f16_small_plan(t, nb)
            raw_ld, rest = divmod(stage - 8 * nb * f["MFS_XCOL"], f["MF_BM"])
            assert rest == 0 and raw_ld % 16 == 0 and unit + 15 <= raw_ld <= unit + 30, (t, nb)   # 16-byte lines
            smem = mmq_f16.small_smem_bytes(t, nb)
            assert 2 <= stages <= f["MFS_STAGES_MAX"] and smem == stages * stage
            assert smem <= (113 if per_sm == 2 else 227) * 1024, (t, nb)
            # two blocks an SM at up to 2 tiles; at 4 for the light types with three stages; never at 8
            light = t in {build.QTYPES[name] for name in build.MMQ_F16_SMALL_LIGHT}
            assert per_sm == (2 if nb <= 2 or (nb == 4 and light and stages >= 3) else 1), (t, nb)
    assert build.mmq_f16_small_plan(build.QTYPES["T_Q4_K"], 4).per_sm == 2     # the 8B's gate / up at 32 columns


def test_decode_attention_takes_tensor_cores_on_an_f16_cache():
    """Decode attention over an f16 cache of head size 64, 128 or 256 runs attention_decode_mma (16 query heads a
    block, its shared memory the query rows and two stages of 64-key K and V tiles, rows padded by 8 halves); an f32
    cache or another head size runs the SIMT attention_decode, which takes GQA groups of up to 8 heads a block."""
    from engine.cuda.launch import decode_kernel
    for d in (64, 128, 256):
        dk = decode_kernel("u16", d, 4, 0.0)
        assert dk == (f"attention_decode_mma<{d}, false>", 16, (16 + 2 * 2 * 64) * (d + 8) * 2)
    assert decode_kernel("u16", 128, 24, 30.0).name == "attention_decode_mma<128, true>"
    assert decode_kernel("float", 128, 4, 0.0) == ("attention_decode<float, 128, 4, false>", 4, 0)
    assert decode_kernel("u16", 96, 3, 0.0) == ("attention_decode<u16, 128, 4, false>", 4, 0)
    assert decode_kernel("float", 64, 24, 0.0).rows == 8
    names = set(build.name_expressions("attention"))
    assert {decode_kernel(kv, d, g, cap).name for kv in ("u16", "float") for d in (64, 80, 128, 256)
            for g in (1, 3, 4, 8, 24) for cap in (0.0, 50.0)} <= names


def test_prefill_tiles_keep_each_sequence_apart():
    """One prefill attention launch serves many sequences' chunks: each run of rows is cut into tiles of at most the
    kernel's query rows (16 on tensor cores, 32 SIMT), none crossing into the next run, together every row once."""
    from engine.cuda.launch import prefill_rows, prefill_tiles
    assert (prefill_rows(True), prefill_rows(False)) == (16, 32)
    runs = [(2, 22), (22, 23), (23, 60), (60, 76)]
    tiles = prefill_tiles(runs, 16)
    assert tiles.dtype == np.int32 and tiles.tolist() == [[2, 16], [18, 4], [22, 1], [23, 16], [39, 16], [55, 5],
                                                          [60, 16]]
    rng = np.random.default_rng()
    cuts = np.unique(rng.integers(1, 300, 12))
    runs = list(zip(cuts[:-1].tolist(), cuts[1:].tolist()))
    for rows in (16, 32):
        tiles = prefill_tiles(runs, rows)
        assert (tiles[:, 1] >= 1).all() and (tiles[:, 1] <= rows).all()
        covered = np.concatenate([np.arange(t, t + c) for t, c in tiles])
        assert covered.tolist() == list(range(cuts[0], cuts[-1]))
        assert all(any(a <= t and t + c <= b for a, b in runs) for t, c in tiles)


def test_source_key_follows_the_source(monkeypatch):
    """An edited kernel source gets another key, so a cubin built from the old one is not loaded."""
    key = build.source_key("rms_norm")
    original = build.expanded_source
    monkeypatch.setattr(build, "expanded_source", lambda f: original(f) + "\n// edited\n")
    assert build.source_key("rms_norm") != key


@pytest.fixture(scope="module")
def prebuilt(tmp_path_factory):
    """(folder, manifest) of cubins built from the current sources: the install's own (`pip install` built them),
    else built here."""
    if NVCC is None:
        pytest.skip("no CUDA compiler on this machine")
    if aot.is_current(build.PREBUILT_DIR):
        return build.PREBUILT_DIR, json.loads((build.PREBUILT_DIR / "manifest.json").read_text())
    folder = tmp_path_factory.mktemp("prebuilt")
    return folder, aot.build_all(folder, log=lambda m: None)


def test_every_family_builds_for_every_architecture(prebuilt):
    """nvcc built each family for each of PREBUILT_ARCHS (aot.compile_family fails on any warning), and each cubin
    holds every kernel the family lists, under the symbol the manifest gives."""
    folder, manifest = prebuilt
    for family in build.FAMILIES:
        for arch in build.family_archs(family):
            table = aot.symbol_table(folder / f"{family}.{arch}.cubin", family)
            assert table == manifest[family]["symbols"]
            assert len(table) == len(build.name_expressions(family))


def test_install_builds_the_kernels():
    """With nvcc on the machine, `pip install` (setup.py) left cubins built from the current sources in the
    package: what the first `engine generate --device cuda` loads instead of compiling."""
    if NVCC is None:
        pytest.skip("no CUDA compiler on this machine")
    assert aot.is_current(build.PREBUILT_DIR), \
        "engine/cuda/prebuilt is missing or older than the sources: pip install -e . (or python -m engine.cuda.aot)"


def test_aot_command_line_reports_a_missing_compiler(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(aot, "find_nvcc", lambda: None)
    assert aot.main(["--out", str(tmp_path)]) == 1
    assert "nvcc not found" in capsys.readouterr().err


def test_prepare_compiles_only_the_models_types(monkeypatch):
    """Without prebuilt kernels, prepare() compiles the groups a model of these types needs, in parallel, and no group
    of another quantized type."""
    compiled = []
    monkeypatch.setattr(build, "_prebuilt", lambda family: None)
    monkeypatch.setattr(build, "_nvrtc_group", lambda family, group, announce: compiled.append((family, group)))
    monkeypatch.setattr(build, "_arch", lambda: "sm_120")
    build.prepare({12, 14})                                       # Q4_K and Q6_K
    groups = {g for _, g in compiled}
    assert {"mmvq<12", "mmvq<14", "mmq<12", "mmq<14", "dequantize_f16<14", "mmvq_tc_q4_K<1", "mmvq_q4_K_pairs<1",
            "mmq_q4_K", "rms_norm<4", "attention<u16", "quantize_q8_1"} <= groups
    assert not {"mmvq<2", "mmq<8", "dequantize_f32<20"} & groups
    assert len(compiled) == len(set(compiled))
    compiled.clear()
    build.prepare({8})                                            # Q8_0 only: none of Q4_K's kernels
    assert not any(g.startswith(("mmvq_tc", "mmvq_pieces", "mmvq_q4_K", "mmq_q4_K", "mmvq<12")) for _, g in compiled)
