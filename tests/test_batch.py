"""Batch bookkeeping, and the fused operations' compositions on the numpy backend (what the CUDA kernels are tested
against)."""
import numpy as np

from engine.backends.base import Batch
from engine.backends.cpu import CPUBackend
from engine.model.rope import inv_freq


def test_batch_ranges_and_runs():
    b = Batch.make([5, 6, 7, 8], [3, 4, 0, 9], [1, 1, 0, 2], [1, 3])
    assert b.seq_ranges == [(1, 0, 2), (0, 2, 3), (2, 3, 4)]
    assert not b.is_one_run()
    assert Batch.single([1, 2, 3], 7).is_one_run()
    assert not Batch.make([1, 2, 3], [7, 8, 10], [0, 0, 0], [2]).is_one_run()      # a gap in the positions
    assert Batch.single([4], 0).is_one_run()


def test_fused_compositions_equal_their_parts():
    B = CPUBackend()
    rng = np.random.default_rng()
    x, r = (rng.standard_normal((3, 64)).astype(np.float32) for _ in range(2))
    w, wr = (rng.standard_normal(64).astype(np.float32) for _ in range(2))
    s, h = B.add_rms_norm(x, r, w, 1e-6, r_norm=wr)
    np.testing.assert_array_equal(s, x + B.rms_norm(r, wr, 1e-6))
    np.testing.assert_array_equal(h, B.rms_norm(s, w, 1e-6))
    gate, up = (rng.standard_normal((32, 64)).astype(np.float32) for _ in range(2))
    np.testing.assert_array_equal(B.glu(gate, up, x, "gelu"), B.geglu(B.mul_mat(gate, x), B.mul_mat(up, x)))
    ws = [gate, up]
    for got, w_ in zip(B.mul_mats(ws, x), ws):
        np.testing.assert_array_equal(got, B.mul_mat(w_, x))
    q = rng.standard_normal((2, 4, 64)).astype(np.float32)
    k = rng.standard_normal((2, 2, 64)).astype(np.float32)
    pos = np.array([5, 6])
    yq, yk = B.rope_qk(q, k, pos, inv_freq(64, 10000.0), True, q_norm=w, k_norm=wr, eps=1e-6)
    np.testing.assert_array_equal(yq, B.rope(B.rms_norm(q, w, 1e-6), pos, inv_freq(64, 10000.0), True))
    np.testing.assert_array_equal(yk, B.rope(B.rms_norm(k, wr, 1e-6), pos, inv_freq(64, 10000.0), True))
    assert list(B.argmax(np.array([[0.0, 2.0, 2.0], [3.0, 1.0, 0.0]]))) == [1, 0]
