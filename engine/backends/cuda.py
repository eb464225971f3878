"""The CUDA backend: weights stay in their GGUF blocks on the GPU, every operation runs on the device.

mul_mat goes through engine/cuda/dispatch.py; the KV cache is f16 (f32 with kv_f32=True); activations are f32 and
treated as immutable (an array's q8_1 quantization is reused by the next mul_mat of the same array). All work runs on
one stream of the backend; decode steps and repeated prefill ubatches are replayed as CUDA graphs
(backends/cuda_graphs.py).
"""
from __future__ import annotations

import cupy as cp
import numpy as np

from ..cuda import build, dispatch, launch
from ..cuda import sampling as device_sampling
from ..cuda.build import ATTENTION_HEAD_CHUNKS, PREFILL_HEAD_DIMS, kernel
from ..cuda.config import CudaConfig, configure
from ..cuda.weights import GPUWeight, upload
from ..gguf import TensorInfo
from ..quants import dequantize
from .base import Backend, Batch, KVCache
from .cuda_graphs import StepGraphs
from .step_shapes import warm_up_shapes


_swiglu = cp.ElementwiseKernel("float32 g, float32 u", "float32 y", "y = g / (1.0f + expf(-g)) * u", "engine_swiglu")
_geglu = cp.ElementwiseKernel(
    "float32 g, float32 u", "float32 y",
    "y = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u", "engine_geglu")


def norm_threads(d: int) -> int:
    """Threads of a norm block (kernels/rms_norm.cu): about two values each, a multiple of 32, at most 1024."""
    return min(1024, max(32, (d // 2 + 31) // 32 * 32))


def attention_head_chunks(head_dim: int) -> int:
    """The MAXE of the attention / attention_split kernel taking head_dim (kernels/attention.cu): the fewest 32-value
    chunks of build.ATTENTION_HEAD_CHUNKS holding it (registers for the keys loaded together)."""
    return next(e for e in ATTENTION_HEAD_CHUNKS if 32 * e >= head_dim)


ATTENTION_TICKETS = 128 * 128     # attention_split's counters: rows x heads of one launch (a mixed step's 128 rows)


class CUDABackend(Backend):
    name = "cuda"

    def __init__(self, kv_f32: bool = False, config: CudaConfig | None = None):
        self.config = config or CudaConfig()
        configure(self.config)                               # the launch rules follow it
        self.kv_dtype = cp.float32 if kv_f32 else cp.float16
        self.stream = cp.cuda.Stream(non_blocking=False)     # orders with the legacy stream (copies, to_numpy)
        self.n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
        self.graphs = StepGraphs(self) if self.config.graphs else None
        self._device_arrays: dict[int, tuple[np.ndarray, cp.ndarray]] = {}
        self._bound: dict[int, tuple[np.ndarray, cp.ndarray]] = {}
        self.acts = dispatch.Activations()     # q8_1 / f16 forms of the last activation multiplied
        self._tickets = cp.zeros(ATTENTION_TICKETS, cp.int32)   # attention_split's counters, one per (row, head)
        self._host_f64: dict[int, tuple[np.ndarray, cp.ndarray]] = {}    # a model's rope frequencies, on the device
        self._qtypes: set[int] = set()          # the weights' GGML types (the kernels to load)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def forward(self, model, batch: Batch, cache):
        if self.graphs is not None:
            return self.graphs.run(model, batch, cache)
        with self.stream:
            return model.forward(batch, cache)

    def warm_up_shapes(self, n_seq: int, max_rows: int) -> list[tuple[int, int]]:
        shapes = super().warm_up_shapes(n_seq, max_rows)
        if self.graphs is None:
            return shapes
        return shapes[:1] + warm_up_shapes(n_seq, max_rows)

    # -- host arrays of the batch, copied once per forward --------------------------------------------------------
    def bind(self, arr: np.ndarray, dev: cp.ndarray) -> None:
        """Use the device array dev for the host array arr (a CUDA graph's input buffer) until unbind()."""
        self._bound[id(arr)] = (arr, dev)

    def unbind(self) -> None:
        self._bound.clear()

    def _dev(self, arr: np.ndarray) -> cp.ndarray:
        hit = self._bound.get(id(arr)) or self._device_arrays.get(id(arr))
        if hit is not None and hit[0] is arr:
            return hit[1]
        if len(self._device_arrays) > 8:
            self._device_arrays.clear()
        d = cp.asarray(np.ascontiguousarray(arr, dtype=np.int32))
        self._device_arrays[id(arr)] = (arr, d)
        return d

    def _dev_f64(self, arr: np.ndarray) -> cp.ndarray:
        """A float64 host array the model keeps (its rope frequencies) on the device, copied once and kept while the
        backend lives (captured graphs hold its address; a model has one to three)."""
        hit = self._host_f64.get(id(arr))
        if hit is None or hit[0] is not arr:
            hit = (arr, cp.asarray(np.ascontiguousarray(arr, dtype=np.float64)))
            self._host_f64[id(arr)] = hit
        return hit[1]

    # -- operations ---------------------------------------------------------------------------------------------
    def weight(self, info: TensorInfo, data: np.ndarray):
        if len(info.np_shape) == 1:
            return cp.asarray(dequantize(data, info.type, info.np_shape))
        m, k = info.np_shape[0], int(np.prod(info.np_shape[1:]))
        self._qtypes.add(int(info.type))
        return upload(info.type, (m, k), data)

    def prepare_kernels(self) -> None:
        build.prepare(self._qtypes)

    def embed(self, table: GPUWeight, tokens, first=None):
        idx = self._dev(tokens)                 # on the device (a graph's input buffer): the masking below replays
        ours = None
        if first is not None:
            local = idx - np.int32(first)
            ours = (local >= 0) & (local < table.m)
            idx = cp.where(ours, local, 0).astype(cp.int32)
        if table.quantized:
            rows = launch.dequantize(table, "f32", rows=idx)                 # [n, n_embd]
        else:
            rows = table.data[idx].astype(cp.float32)
        return rows if ours is None else rows * ours[:, None]

    def mul_mat(self, w: GPUWeight, x):
        return dispatch.mul_mat(w, cp.ascontiguousarray(x, dtype=cp.float32), acts=self.acts)

    def mul_mats(self, ws, x):
        return dispatch.mul_mats(list(ws), cp.ascontiguousarray(x, dtype=cp.float32), acts=self.acts)

    def glu(self, gate, up, x, act):
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        y = dispatch.glu(gate, up, x, act, acts=self.acts)
        return y if y is not None else super().glu(gate, up, x, act)

    def rms_norm(self, x, w, eps):
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        d = x.shape[-1]
        y = cp.empty_like(x)
        rows = x.size // d
        if rows:
            kernel("rms_norm", "rms_norm")((rows,), (norm_threads(d),), (x, w, y, np.int32(d), np.float32(eps)))
        return y

    def add_rms_norm(self, x, r, w, eps, r_norm=None):
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        r = cp.ascontiguousarray(r, dtype=cp.float32)
        d = x.shape[-1]
        s, y = cp.empty_like(x), cp.empty_like(x)
        rows = x.size // d
        q8 = (np.uint64(0),) * 3
        if 0 < rows <= 8 and d % 32 == 0:              # a decode step: y goes to MMVQ, write its q8_1 blocks too
            q8 = self._q8_1_planes(rows, d)
            self.acts.put_q8_1(y, q8)
            q8 = (*q8, np.uint64(0))[:3]
        if rows:
            kernel("rms_norm", "add_rms_norm")(
                (rows,), (norm_threads(d),),
                (x, r, r_norm if r_norm is not None else np.uint64(0), w, s, y, *q8, np.int32(d), np.float32(eps)))
        return s, y

    def rope_qk(self, q, k, positions, inv_freq, neox, q_norm=None, k_norm=None, eps=0.0, mscale=1.0):
        n, n_head, d = q.shape
        if d % 64 or d > 256 or n == 0:
            return super().rope_qk(q, k, positions, inv_freq, neox, q_norm, k_norm, eps, mscale)
        q = cp.ascontiguousarray(q, dtype=cp.float32)
        k = cp.ascontiguousarray(k, dtype=cp.float32)
        yq, yk = cp.empty_like(q), cp.empty_like(k)
        n_rot = 2 * len(inv_freq)
        null = np.uint64(0)
        kernel("rope", "rope_qk")((n, n_head + k.shape[1]), (d // 2,),
                                  (q, k, yq, yk, q_norm if q_norm is not None else null,
                                   k_norm if k_norm is not None else null, self._dev_f64(inv_freq), self._dev(positions),
                                   np.int32(n_head), np.int32(k.shape[1]), np.int32(d), np.int32(n_rot),
                                   np.int32(1 if neox else 0), np.float32(eps), np.float32(mscale)))
        return yq, yk

    def rope(self, x, positions, inv_freq, neox, mscale=1.0):
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        n, heads, head_dim = x.shape
        y = cp.empty_like(x)
        pairs = n * (head_dim // 2)
        if pairs:
            kernel("rope", "rope")(((pairs + 255) // 256,), (256,),
                                   (x, y, self._dev(positions), np.int32(n), np.int32(heads), np.int32(head_dim),
                                    np.int32(2 * len(inv_freq)), self._dev_f64(inv_freq), np.int32(1 if neox else 0),
                                    np.float32(mscale)))
        return y

    def kv_cache(self, n_layer, n_seq, n_ctx, n_head_kv, head_dim):
        cache = KVCache(cp, n_layer, n_seq + 1, n_ctx, n_head_kv, head_dim, self.kv_dtype)
        cache.pad_slot = n_seq                   # graph replays of decode steps pad their batch with this slot
        return cache

    def attention(self, q, k, v, cache, layer, batch: Batch, scale, window, softcap=0.0):
        n, n_head, d = q.shape
        if d % 32 or d > 256:
            raise ValueError(f"head_dim {d} is not supported by the attention kernel (a multiple of 32, <= 256)")
        seq_ids, positions = self._dev(batch.seq_ids), self._dev(batch.positions)
        k = cp.ascontiguousarray(k, dtype=cp.float32)
        v = cp.ascontiguousarray(v, dtype=cp.float32)
        q = cp.ascontiguousarray(q, dtype=cp.float32)
        ctx = (cache, layer, scale, window, softcap)
        if batch.per_row:                                            # every row its own query: store all k, v first
            self._kv_store(k, v, seq_ids, positions, ctx)
            n_split = self._n_split(n, n_head)
            if n_split:
                return self._attention_split(q, None, None, seq_ids, positions, n_split, ctx)
            out = cp.empty((n, n_head, d), cp.float32)
            self._attention_plain(q, seq_ids, positions, out, ctx)
            return out.reshape(n, n_head * d)
        n_decode = batch.n_single_prefix()                          # leading one-token sequences: decode rows
        if len(batch.seq_ranges) == 1 or n_decode == n:              # one prefill ubatch, or a decode step
            n_split = self._n_split(n, n_head)
            if n_split >= 2 or (n_split and n_decode == n):          # few queries, or decode rows: split kernel
                if n_decode == n:                                    # ... the split kernel stores k, v itself
                    return self._attention_split(q, k, v, seq_ids, positions, n_split, ctx)
                self._kv_store(k, v, seq_ids, positions, ctx)
                return self._attention_split(q, None, None, seq_ids, positions, n_split, ctx)
            self._kv_store(k, v, seq_ids, positions, ctx)
            if batch.is_one_run():
                return self._attention_run(q, seq_ids, positions, ctx).reshape(n, n_head * d)
            out = cp.empty((n, n_head, d), cp.float32)
            self._attention_plain(q, seq_ids, positions, out, ctx)
            return out.reshape(n, n_head * d)
        self._kv_store(k, v, seq_ids, positions, ctx)              # mixed: decode rows first, then prefill chunks
        out = cp.empty((n, n_head, d), cp.float32)                   # out: [n, n_head, head_dim]
        if n_decode:                                                 # mixed: the decode rows together ...
            n_split = self._n_split(n_decode, n_head)
            rows = slice(0, n_decode)
            if n_split:
                out[rows] = self._attention_split(q[rows], None, None, seq_ids[rows], positions[rows], n_split,
                                                  ctx).reshape(n_decode, n_head, d)
            else:
                self._attention_plain(q[rows], seq_ids[rows], positions[rows], out[rows], ctx)
        for _, a, b in batch.seq_ranges:                             # ... then each prefill chunk
            if b - a > 1 or a >= n_decode:
                rows = slice(a, b)
                out[rows] = self._attention_run(q[rows], seq_ids[rows], positions[rows], ctx)
        return out.reshape(n, n_head * d)

    def _n_split(self, n: int, n_head: int) -> int:
        """Key chunks per (token, head) of attention_split: enough blocks for 4 per SM, at most 32, at least 1 (its
        four warps per (token, head) keep more loads in flight than the one-warp kernel: 40.6 -> 29.3 us per layer
        of a 32-sequence decode step of the 8B, ncu); 0 where its counters do not reach the rows x heads."""
        if n * n_head > ATTENTION_TICKETS:
            return 0
        return max(1, min(32, 4 * self.n_sm // (n * n_head)))

    @staticmethod
    def _kv_type(cache, layer) -> str:
        return "float" if cache.k[layer].dtype == cp.float32 else "u16"

    def _kv_store(self, k, v, seq_ids, positions, ctx) -> None:
        cache, layer = ctx[:2]
        n, row = k.shape[0], k.shape[1] * k.shape[2]
        kernel("attention", f"kv_store<{self._kv_type(cache, layer)}>")(
            ((n * row + 255) // 256,), (256,), (k, v, cache.k[layer], cache.v[layer], seq_ids, positions,
                                                np.int32(n), np.int32(cache.n_ctx), np.int32(row)))

    @staticmethod
    def _tail(q, seq_ids, positions, ctx) -> tuple:
        """The arguments attention and attention_split take after their arrays."""
        cache, layer, scale, window, softcap = ctx
        return (seq_ids, positions, np.int32(q.shape[1]), np.int32(cache.k[layer].shape[2]), np.int32(q.shape[2]),
                np.int32(cache.n_ctx), np.float32(scale), np.int32(window or 0), np.float32(softcap))

    def _attention_split(self, q, k, v, seq_ids, positions, n_split, ctx):
        """Few query tokens (decode), split over the keys; stores k, v first when given. -> [n, n_head*head_dim],
        with its q8_1 blocks registered for the next mul_mat."""
        cache, layer = ctx[:2]
        n, n_head, d = q.shape
        out = cp.empty((n, n_head, d), cp.float32)
        part = cp.empty((n, n_head, n_split, d + 2), cp.float32)     # per chunk: max, sum, output[head_dim]
        q8 = self._q8_1_planes(n, n_head * d)                        # out as q8_1 (and its residual plane)
        kernel("attention", f"attention_split<{self._kv_type(cache, layer)}, {attention_head_chunks(d)}, "
                            f"{'true' if ctx[4] else 'false'}>")(
            (n, n_head, n_split), (32, 4),
            (q, cache.k[layer], cache.v[layer], out, *self._tail(q, seq_ids, positions, ctx), part,
             self._tickets, *(*q8, np.uint64(0))[:3], *((k, v) if k is not None else (np.uint64(0),) * 2)))
        out = out.reshape(n, n_head * d)
        self.acts.put_q8_1(out, q8)
        return out

    @staticmethod
    def _q8_1_planes(rows: int, d: int) -> tuple:
        """Buffers for the q8_1 blocks of a [rows, d] activation a kernel writes for the next mul_mat: (qs, ds), and
        the residual plane rs where those rows are multiplied on 16-bit activations (dispatch.residual_rows)."""
        q8 = (cp.empty((rows, d), cp.int8), cp.empty((rows, d // 8), cp.float32))
        return q8 + (cp.empty((rows, d), cp.int8),) if dispatch.residual_rows(rows) else q8

    def _attention_plain(self, q, seq_ids, positions, out, ctx) -> None:
        cache, layer = ctx[:2]
        n, n_head, d = q.shape
        kernel("attention", f"attention<{self._kv_type(cache, layer)}, {attention_head_chunks(d)}, "
                            f"{'true' if ctx[4] else 'false'}>")(
            (n, n_head), (32,), (q, cache.k[layer], cache.v[layer], out, *self._tail(q, seq_ids, positions, ctx)))

    def _attention_run(self, q, seq_ids, positions, ctx):
        """Query tokens of one sequence at consecutive positions (a prefill chunk) -> [n, n_head, head_dim]."""
        cache, layer, scale, window, softcap = ctx
        n, n_head, d = q.shape
        out = cp.empty((n, n_head, d), cp.float32)
        if d not in PREFILL_HEAD_DIMS or n == 1:
            self._attention_plain(q, seq_ids, positions, out, ctx)
            return out
        pargs = (q, cache.k[layer], cache.v[layer], out, seq_ids, positions, np.int32(n), np.int32(n_head),
                 np.int32(cache.k[layer].shape[2]), np.int32(cache.n_ctx), np.float32(scale), np.int32(window or 0),
                 np.float32(softcap))
        if self._kv_type(cache, layer) == "u16":                     # f16 tensor cores
            launch.attention_prefill_mma(d, ((n + 15) // 16, n_head), pargs)
        else:
            launch.attention_prefill_simt(d, ((n + 31) // 32, n_head), pargs)
        return out

    def swiglu(self, gate, up):
        return _swiglu(gate, up)

    def geglu(self, gate, up):
        return _geglu(gate, up)

    def add(self, a, b):
        return a + b

    def softcap(self, x, cap):
        return cp.tanh(x * np.float32(1.0 / cap)) * np.float32(cap)

    def scale(self, x, s):
        return x * np.float32(s)

    def rows(self, x, idx):
        return x[self._dev(idx)]

    def argmax(self, logits):
        n, m = logits.shape
        best = cp.zeros(n, cp.uint64)                                 # kernels/argmax.cu keys: only n cross to the host
        with self.stream:
            x = cp.ascontiguousarray(logits, dtype=cp.float32)
            kernel("argmax", "argmax_rows")((min(64, -(-m // 4096)), n), (256,), (x, best, np.int32(m)))
            keys = best.get()
        return (0xFFFFFFFF - (keys & 0xFFFFFFFF)).astype(np.int64)

    def constrain(self, logits, rows, masks, bias):
        with self.stream:
            x = cp.ascontiguousarray(logits, dtype=cp.float32)
            device_sampling.constrain(x, rows, masks, bias)
        return x

    def sample(self, logits, samplers, histories):
        if all(s.is_greedy for s in samplers):
            return self.argmax(logits)
        with self.stream:
            return device_sampling.sample(logits, samplers, histories)

    def to_numpy(self, x):
        return cp.asnumpy(x).astype(np.float32, copy=False)


__all__ = ["CUDABackend"]
