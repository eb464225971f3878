"""The CUDA backend: weights stay in their GGUF blocks on the GPU, every operation runs on the device.

mul_mat goes through engine/cuda/dispatch.py; the KV cache is f16 (f32 with kv_f32=True); activations are f32.
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from ..cuda import dispatch, launch
from ..cuda.build import kernel
from ..cuda.weights import GPUWeight, upload
from ..gguf import TensorInfo
from ..quants import dequantize
from .base import Backend, Batch, KVCache


_swiglu = cp.ElementwiseKernel("float32 g, float32 u", "float32 y", "y = g / (1.0f + expf(-g)) * u", "engine_swiglu")
_geglu = cp.ElementwiseKernel(
    "float32 g, float32 u", "float32 y",
    "y = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u", "engine_geglu")


class CUDABackend(Backend):
    name = "cuda"

    def __init__(self, kv_f32: bool = False):
        self.kv_dtype = cp.float32 if kv_f32 else cp.float16
        self._device_arrays: dict[int, tuple[np.ndarray, cp.ndarray]] = {}

    def synchronize(self) -> None:
        cp.cuda.get_current_stream().synchronize()

    # -- host arrays of the batch, copied once per forward --------------------------------------------------------
    def _dev(self, arr: np.ndarray) -> cp.ndarray:
        hit = self._device_arrays.get(id(arr))
        if hit is not None and hit[0] is arr:
            return hit[1]
        if len(self._device_arrays) > 8:
            self._device_arrays.clear()
        d = cp.asarray(np.ascontiguousarray(arr, dtype=np.int32))
        self._device_arrays[id(arr)] = (arr, d)
        return d

    # -- operations ---------------------------------------------------------------------------------------------
    def weight(self, info: TensorInfo, data: np.ndarray):
        if len(info.np_shape) == 1:
            return cp.asarray(dequantize(data, info.type, info.np_shape))
        m, k = info.np_shape[0], int(np.prod(info.np_shape[1:]))
        return upload(info.type, (m, k), data)

    def embed(self, table: GPUWeight, tokens):
        idx = self._dev(tokens)
        if table.quantized:
            return launch.dequantize(table, "f32", rows=idx)                 # [n, n_embd]
        return table.data[idx].astype(cp.float32)

    def mul_mat(self, w: GPUWeight, x):
        return dispatch.mul_mat(w, cp.ascontiguousarray(x, dtype=cp.float32))

    def rms_norm(self, x, w, eps):
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        d = x.shape[-1]
        y = cp.empty_like(x)
        rows = x.size // d
        if rows == 0:
            return y
        kernel("rms_norm", "rms_norm")((rows,), (256,), (x, w, y, np.int32(d), np.float32(eps)))
        return y

    def rope(self, x, positions, n_rot, base, neox):
        x = cp.array(x, dtype=cp.float32, copy=True, order="C")
        n, heads, head_dim = x.shape
        pairs = n * heads * (n_rot // 2)
        kernel("rope", "rope")(((pairs + 255) // 256,), (256,),
                               (x, self._dev(positions), np.int32(n), np.int32(heads), np.int32(head_dim),
                                np.int32(n_rot), np.float64(base), np.int32(1 if neox else 0)))
        return x

    def kv_cache(self, n_layer, n_seq, n_ctx, n_head_kv, head_dim):
        return KVCache(cp, n_layer, n_seq, n_ctx, n_head_kv, head_dim, self.kv_dtype)

    def attention(self, q, k, v, cache, layer, batch: Batch, scale, window):
        n, n_head, d = q.shape
        n_kv = k.shape[1]
        if d % 32 or d > 256:
            raise ValueError(f"head_dim {d} is not supported by the attention kernel (a multiple of 32, <= 256)")
        kt = "float" if cache.k[layer].dtype == cp.float32 else "u16"
        seq_ids, positions = self._dev(batch.seq_ids), self._dev(batch.positions)
        k = cp.ascontiguousarray(k, dtype=cp.float32)
        v = cp.ascontiguousarray(v, dtype=cp.float32)
        row = n_kv * d
        kernel("attention", f"kv_store<{kt}>")(((n * row + 255) // 256,), (256,),
                                                (k, v, cache.k[layer], cache.v[layer], seq_ids, positions,
                                                 np.int32(n), np.int32(cache.n_ctx), np.int32(row)))
        out = cp.empty((n, n_head, d), cp.float32)
        kernel("attention", f"attention<{kt}>")((n, n_head), (32,),
                                                 (cp.ascontiguousarray(q, dtype=cp.float32), cache.k[layer],
                                                  cache.v[layer], out, seq_ids, positions, np.int32(n_head),
                                                  np.int32(n_kv), np.int32(d), np.int32(cache.n_ctx),
                                                  np.float32(scale), np.int32(window or 0)))
        return out.reshape(n, n_head * d)

    def swiglu(self, gate, up):
        return _swiglu(gate, up)

    def geglu(self, gate, up):
        return _geglu(gate, up)

    def add(self, a, b):
        return a + b

    def scale(self, x, s):
        return x * np.float32(s)

    def rows(self, x, idx):
        return x[self._dev(idx)]

    def to_numpy(self, x):
        return cp.asnumpy(x).astype(np.float32, copy=False)


__all__ = ["CUDABackend"]
