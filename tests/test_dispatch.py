"""The mul_mat dispatch table (no GPU needed: the choice is made from the weight's type and shape)."""
import pytest

from engine.cuda.dispatch import Activations, choose_path, resolve_path
from engine.cuda.weights import GPUWeight
from engine.quants import GGMLType

SM90 = (9, 0)


def weight(t, m, k):
    return GPUWeight(t, m, k, None, 0)


def test_sm90_table():
    small, large = weight(GGMLType.Q4_K, 576, 1536), weight(GGMLType.Q4_K, 4096, 14336)
    for n in (1, 5, 8):
        assert choose_path(small, n, SM90) == "mmvq" and choose_path(large, n, SM90) == "mmvq"
    for n in (9, 64, 512):                                   # dequantize + cuBLAS: 2-5x our MMQ, f16 activations
        assert choose_path(small, n, SM90) == "dequant" and choose_path(large, n, SM90) == "dequant"
    assert choose_path(weight(GGMLType.IQ4_XS, 64, 256), 1, SM90) == "mmvq"
    f16 = weight(GGMLType.F16, 4096, 4096)
    assert choose_path(f16, 8, SM90) == "mmvf" and choose_path(f16, 9, SM90) == "cublas"


def test_forced_paths(monkeypatch):
    w = weight(GGMLType.Q8_0, 4096, 4096)
    monkeypatch.setenv("ENGINE_MUL_MAT_PATH", "mmq")
    assert resolve_path(w, 3) == "mmq"
    assert resolve_path(weight(GGMLType.F32, 64, 64), 3) == "mmvf"     # float weights have no q8_1 path
    monkeypatch.setenv("ENGINE_MUL_MAT_PATH", "mmvq")
    with pytest.raises(ValueError, match="at most 8"):
        resolve_path(w, 9)
    monkeypatch.setenv("ENGINE_MUL_MAT_PATH", "bogus")
    with pytest.raises(ValueError, match="unknown mul_mat path"):
        resolve_path(w, 3)


def test_activation_forms_follow_the_last_array():
    """A kernel's q8_1 output is reused for the same array only; another array starts afresh."""
    acts, x, y = Activations(), object(), object()
    acts.put_q8_1(x, ("qs", "ds"))
    assert acts.q8_1(x) == ("qs", "ds")
    acts.put_q8_1(y, ("qs2", "ds2"))
    assert acts.forms == {("q8_1", None): ("qs2", "ds2")} and acts.x is y
    acts.clear()
    assert acts.x is None and acts.forms == {}
