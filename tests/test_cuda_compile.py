"""Every CUDA kernel family compiles with nvcc for sm_80, sm_89 and sm_90 (no GPU needed)."""
import os
import shutil
import subprocess

import pytest

from engine.cuda.build import FAMILIES, QTYPES, check_type_list, expanded_source


def find_nvcc():
    for c in (shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"):
        if c and os.path.exists(c):
            return c
    return None


NVCC = find_nvcc()


def test_type_lists_agree():
    check_type_list()
    assert len(QTYPES) == 12


def nvcc_compile(tmp_path, family: str, arch: str, *defines: str) -> subprocess.CompletedProcess:
    """nvcc -c of a kernel family's expanded source for arch, with extra -D defines."""
    src = tmp_path / f"{family}.cu"
    src.write_text(expanded_source(family))
    return subprocess.run([NVCC, f"-arch={arch}", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o"),
                           *defines], capture_output=True, text=True, timeout=600)


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler on this machine")
@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90"])
@pytest.mark.parametrize("family", FAMILIES)
def test_compiles(tmp_path, family, arch):
    r = nvcc_compile(tmp_path, family, arch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "warning" not in r.stderr.lower(), r.stderr[-3000:]


def kernel_constants(family: str) -> dict[str, int]:
    """The integer #defines of a kernel family's file (after common.cuh), evaluated."""
    import re
    defs = dict(re.findall(r"^#define (\w+) (.+?)\s*(?://.*)?$", expanded_source(family), re.M))
    values = {}

    def value(name):
        if name not in values:
            expr = re.sub(r"[A-Za-z_]\w*", lambda mt: str(value(mt.group(0))), defs[name])
            expr = re.sub(r"\(([^()?]+)\?([^():]+):([^()]+)\)", r"((\2) if (\1) else (\3))", expr)   # a ? b : c
            values[name] = int(eval(expr.replace("/", "//"), {"__builtins__": {}}))
        return values[name]
    return {name: value(name) for name in defs if re.fullmatch(r"[\d\s()+*/<>?:A-Z_-]+", defs[name])}


def test_launch_constants_match_kernels():
    """launch.py's copies of the MMQ tile and shared-memory sizes equal the ones kernels/mmq.cu defines."""
    from engine.cuda import launch
    c = kernel_constants("mmq")
    assert (c["MMQ_BM"], c["MMQ_BN"], c["MMQ_KT"]) == (launch.MMQ_BM, launch.MMQ_BN, launch.MMQ_KT)
    assert c["MMQ_SMEM_BYTES"] == launch.MMQ_SMEM_BYTES and c["MMQK_SMEM_BYTES"] == launch.MMQK_SMEM_BYTES


def test_mmvq_tc_constants_match_launch():
    """launch.py's copies of mmvq_tc_q4_K's warps (and where its blocks are twice as wide), range cap and stages, and
    its window size in mmvqt_smem_bytes, equal kernels/mmvq.cu's."""
    from engine.cuda import launch
    c = kernel_constants("mmvq")
    assert (c["MMVQT_WARPS"], c["MMVQT_MAX_RANGE"], c["MMVQT_STAGES"], c["MMVQT_WIDE_FROM"]) == \
        (launch.MMVQT_WARPS, launch.MMVQT_MAX_RANGE, launch.MMVQT_STAGES, launch.MMVQT_WIDE_FROM)
    acts_and_sums = 8 * 8 * (32 + 8) + c["MMVQT_WARPS"] * 16 * 4     # k = 256, one column: 8 chunks x 8 B columns
    assert launch.mmvqt_smem_bytes(256, 1, 1) == acts_and_sums + c["MMVQT_WARPS"] * 16 * c["MMVQT_WIN_LD"]
    wide = 2 * c["MMVQT_WARPS"]                                     # 8 columns: twice the warps
    assert launch.mmvqt_warps(8) == wide and launch.mmvqt_warps(c["MMVQT_WIDE_FROM"] - 1) == c["MMVQT_WARPS"]
    assert launch.mmvqt_smem_bytes(256, 8, 1) == 8 * 8 * (32 + 8) + wide * (16 * 8 * 4 + 16 * c["MMVQT_WIN_LD"])


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler on this machine")
def test_mmvq_tc_diagnostic_build_compiles(tmp_path):
    """mmvq_tc_q4_K's timing diagnostics (MMVQT_DIAG, MMVQT_TRACE; scripts/bench_mmvq_tc_variants.py) still build."""
    r = nvcc_compile(tmp_path, "mmvq", "sm_90", "-DMMVQ_SKIP_MMA", "-DMMVQ_ONLY_TYPE=12", "-DMMVQT_DIAG=15",
                     "-DMMVQT_TRACE")
    assert r.returncode == 0, r.stderr[-3000:]
