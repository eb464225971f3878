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
