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


@pytest.mark.skipif(NVCC is None, reason="no CUDA compiler on this machine")
@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90"])
@pytest.mark.parametrize("family", FAMILIES)
def test_compiles(tmp_path, family, arch):
    src = tmp_path / f"{family}.cu"
    src.write_text(expanded_source(family))
    r = subprocess.run([NVCC, f"-arch={arch}", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "k.o")],
                       capture_output=True, text=True, timeout=600)
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
            values[name] = int(eval(expr.replace("/", "//"), {"__builtins__": {}}))
        return values[name]
    return {name: value(name) for name in defs if re.fullmatch(r"[\d\s()+*/A-Z_-]+", defs[name])}


def test_launch_constants_match_kernels():
    """launch.py's copies of the MMQ tile and shared-memory sizes equal the ones kernels/mmq.cu defines."""
    from engine.cuda import launch
    c = kernel_constants("mmq")
    assert (c["MMQ_BM"], c["MMQ_BN"], c["MMQ_KT"]) == (launch.MMQ_BM, launch.MMQ_BN, launch.MMQ_KT)
    assert c["MMQ_SMEM_BYTES"] == launch.MMQ_SMEM_BYTES and c["MMQK_SMEM_BYTES"] == launch.MMQK_SMEM_BYTES
