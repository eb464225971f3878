"""The CUDA backend: weights stay in their GGUF blocks on the GPU, every operation runs on the device.

mul_mat goes through engine/cuda/dispatch.py; the KV cache is f16 (f32 with kv_f32=True, GGML's q8_0 blocks with
kv_type="q8_0"); activations are f32 and
treated as immutable (an array's q8_1 quantization is reused by the next mul_mat of the same array). All work runs on
one stream of the backend; decode steps and repeated prefill ubatches are replayed as CUDA graphs
(backends/cuda_graphs.py).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import cupy as cp
import numpy as np

from ..cuda import build, dispatch, launch
from ..cuda import sampling as device_sampling
from ..cuda.build import ATTENTION_HEAD_CHUNKS, DECODE_HEAD_DIMS, PREFILL_HEAD_DIMS, kernel
from ..cuda.config import PREFILL_UBATCH, CudaConfig, configure
from ..cuda.launch import DecodeKernel, decode_kernel
from ..cuda.weights import GPUWeight, upload
from ..gguf import TensorInfo
from ..quants import dequantize
from .base import Q8_0, Backend, Batch, KVCache, check_q8_0_head_dim
from .cuda_graphs import StepGraphs
from .step_shapes import warm_up_shapes


_SWIGLU = "y = g / (1.0f + expf(-g)) * u"
_GEGLU = "y = 0.5f * g * (1.0f + tanhf(0.7978845608028654f * (g + 0.044715f * g * g * g))) * u"
_swiglu = cp.ElementwiseKernel("float32 g, float32 u", "float32 y", _SWIGLU, "engine_swiglu")
_geglu = cp.ElementwiseKernel("float32 g, float32 u", "float32 y", _GEGLU, "engine_geglu")
# the same, y also in f16 (its f16 form for the next mul_mat, dispatch.writes_f16)
_swiglu_f16 = cp.ElementwiseKernel("float32 g, float32 u", "float32 y, float16 h", _SWIGLU + "; h = y",
                                   "engine_swiglu_f16")
_geglu_f16 = cp.ElementwiseKernel("float32 g, float32 u", "float32 y, float16 h", _GEGLU + "; h = y",
                                  "engine_geglu_f16")


def norm_threads(d: int) -> int:
    """Threads of a norm block (kernels/rms_norm.cu): about two values each, a multiple of 32, at most 1024."""
    return min(1024, max(32, (d // 2 + 31) // 32 * 32))


def norm_values(d: int) -> int:
    """The NV of the norm kernels for rows of d: the values a thread holds (build.NORM_VALUES)."""
    need = -(-d // norm_threads(d))
    nv = next((v for v in build.NORM_VALUES if v >= need), None)
    if nv is None:
        raise NotImplementedError(f"rows of {d} values: the CUDA norm kernels take at most "
                                  f"{build.NORM_VALUES[-1] * 1024}")
    return nv


def attention_head_chunks(head_dim: int) -> int:
    """The MAXE of the attention kernel taking head_dim (kernels/attention.cu): the fewest 32-value chunks of
    build.ATTENTION_HEAD_CHUNKS holding it (registers for the keys loaded together)."""
    return next(e for e in ATTENTION_HEAD_CHUNKS if 32 * e >= head_dim)


def decode_chunks(max_keys: int, chunk_cap: int) -> int:
    """attention_decode's chunks for a sequence of max_keys keys at most (kernels/attention.cu decode_chunk): its part
    buffer's chunk stride."""
    return min(chunk_cap, -(-max_keys // build.constants("attention")["DECODE_CHUNK_KEYS"]))


class AttentionCall(NamedTuple):
    """What every attention kernel of one backend.attention call takes beside its rows."""
    cache: KVCache
    layer: int
    scale: float
    window: int | None
    softcap: float
    paging: tuple            # (tables, width, shift, rows): CUDABackend._paging


KV_KERNEL_TYPES = {np.dtype(np.float32): "float", np.dtype(np.float16): "u16",   # a cache's dtype -> its
                   np.dtype(np.uint8): "kvq8_0"}                                # attention.cu value type
ATTENTION_TICKETS = 128 * 128     # attention_decode's counters: rows x blocks per row of a launch (a mixed step's 128)
INVARIANT_ROWS = 128              # rows per attention_decode launch in batch-invariant mode (its part buffer's size)
DECODE_BLOCKS_PER_SM = 4          # decode attention's blocks: enough for this many per SM, where the keys allow


class GPUKVCache(KVCache):
    """The KV cache on the GPU: copy_prefix is one cudaMemcpy2DAsync per array (a row of n positions per layer), no
    kernel, so no compile under the first request that shares a prefix (CuPy's strided copy built one: a 212 ms step
    in the first burst on the H100, BENCHMARKS.md)."""

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        stream = cp.cuda.get_current_stream().ptr
        for a in (self.k_layers, self.v_layers):          # [n_layer, n_blocks, block_size, n_head_kv, row_elems]
            layer_pitch, block_pitch, width = a.strides[0], a.strides[1], n * a.strides[2]
            src_ptr, dst_ptr = a.data.ptr + src * block_pitch, a.data.ptr + dst * block_pitch
            if layer_pitch <= _max_pitch(cp.cuda.Device().id):
                cp.cuda.runtime.memcpy2DAsync(dst_ptr, layer_pitch, src_ptr, layer_pitch, width, a.shape[0], _D2D,
                                              stream)
                continue
            for layer in range(a.shape[0]):               # layers further apart than a 2D copy's pitch: one copy each
                off = layer * layer_pitch
                cp.cuda.runtime.memcpyAsync(dst_ptr + off, src_ptr + off, width, _D2D, stream)


_D2D = cp.cuda.runtime.memcpyDeviceToDevice
_MAX_PITCH_ATTRIBUTE = 11                  # cudaDevAttrMaxPitch


@functools.cache
def _max_pitch(device: int) -> int:
    """The largest pitch (bytes) cudaMemcpy2D takes on the device."""
    return cp.cuda.runtime.deviceGetAttribute(_MAX_PITCH_ATTRIBUTE, device)


class CUDABackend(Backend):
    name = "cuda"
    prefill_ubatch = PREFILL_UBATCH
    paged_kv = True
    kv_types = ("f16", "q8_0")

    def __init__(self, kv_f32: bool = False, config: CudaConfig | None = None):
        self.config = config or CudaConfig()
        configure(self.config)                               # the launch rules follow it
        self.kv_dtype = cp.float32 if kv_f32 else cp.float16
        self.stream = cp.cuda.Stream(non_blocking=False)     # orders with the legacy stream (copies, to_numpy)
        self.n_sm = cp.cuda.Device().attributes["MultiProcessorCount"]
        self._chunk_caps: dict[tuple[DecodeKernel, int], int] = {}    # _chunk_cap's
        self.graphs = StepGraphs(self) if self.config.graphs else None
        self._device_arrays: dict[int, tuple[np.ndarray, cp.ndarray]] = {}
        self._bound: dict[int, tuple[np.ndarray, cp.ndarray]] = {}
        self.acts = dispatch.Activations()     # q8_1 / f16 forms of the last activation multiplied
        # batch-invariant mode: besides the mul_mat chain's choice (dispatch.py), attention takes every row alone
        # (_attention_rows); the q8_1 blocks a norm or attention kernel writes beside its output are those
        # quantize_q8_1 writes, bit for bit (tests/test_cuda_ops.py), so they serve in that mode too
        self.invariant = self.config.batch_invariant
        self._tickets = cp.zeros(ATTENTION_TICKETS, cp.int32)   # attention_decode's counters, per (row, KV group)
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
            kernel("rms_norm", f"rms_norm<{norm_values(d)}>")((rows,), (norm_threads(d),),
                                                              (x, w, y, np.int32(d), np.float32(eps)))
        return y

    def add_rms_norm(self, x, r, w, eps, r_norm=None):
        x = cp.ascontiguousarray(x, dtype=cp.float32)
        r = cp.ascontiguousarray(r, dtype=cp.float32)
        d = x.shape[-1]
        s, y = cp.empty_like(x), cp.empty_like(x)
        rows = x.size // d
        null = np.uint64(0)
        qs = ds = rs = h = null
        if 0 < rows <= 8 and d % 32 == 0:              # a decode step: y goes to MMVQ, write its q8_1 blocks too
            planes = self._q8_1_planes(rows, d)
            self.acts.put_q8_1(y, planes)
            qs, ds, *residual = planes
            rs = residual[0] if residual else null
        if dispatch.writes_f16(rows):                  # more rows: y's f16 form, for mmq_f16 or cuBLAS
            h = cp.empty(x.shape, cp.float16)
            self.acts.put_f16(y, h)
        if rows:
            kernel("rms_norm", f"add_rms_norm<{norm_values(d)}>")(
                (rows,), (norm_threads(d),),
                (x, r, r_norm if r_norm is not None else null, w, s, y, qs, ds, rs, h, np.int32(d), np.float32(eps)))
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

    def kv_cache(self, n_layer, n_blocks, block_size, n_head_kv, head_dim, kv_type=None):
        if kv_type == "q8_0":                    # each head row: head_dim / 32 q8_0 blocks, as bytes
            check_q8_0_head_dim(head_dim)
            cache = GPUKVCache(cp, n_layer, n_blocks + 1, block_size, n_head_kv, head_dim, cp.uint8,
                               Q8_0.row_bytes(head_dim))
        else:
            cache = GPUKVCache(cp, n_layer, n_blocks + 1, block_size, n_head_kv, head_dim,
                               cp.float16 if kv_type == "f16" else self.kv_dtype)
        cache.pad_slot = n_blocks                # graph replays pad their batch with rows writing this spare block
        cache.whole_tables = cp.arange(n_blocks + 1, dtype=cp.int32)   # [n_blocks + 1]: block i is row i's table
        return cache

    def attention(self, q, k, v, cache, layer, batch: Batch, scale, window, softcap=0.0):
        n, n_head, d = q.shape
        if d % 32 or d > 256:
            raise ValueError(f"head_dim {d} is not supported by the attention kernel (a multiple of 32, <= 256)")
        tabs, paging = self._paging(batch, cache)
        positions = self._dev(batch.positions)
        k = cp.ascontiguousarray(k, dtype=cp.float32)
        v = cp.ascontiguousarray(v, dtype=cp.float32)
        q = cp.ascontiguousarray(q, dtype=cp.float32)
        ctx = AttentionCall(cache, layer, scale, window, softcap, paging)
        if self.invariant:
            self._kv_store(k, v, tabs, positions, ctx)
            return self._attention_rows(q, tabs, positions, ctx)
        if batch.per_row:                                            # every row its own query: store all k, v first
            self._kv_store(k, v, tabs, positions, ctx)
            if self._decode_fits(n, n_head, ctx):
                return self._attention_decode(q, None, None, tabs, positions, ctx)
            out = cp.empty((n, n_head, d), cp.float32)
            self._attention_plain(q, tabs, positions, out, ctx)
            return out.reshape(n, n_head * d)
        n_decode = batch.n_single_prefix()                          # leading one-token sequences: decode rows
        if len(batch.seq_ranges) == 1 or n_decode == n:              # one prefill ubatch, or a decode step
            if self._decode_fits(n, n_head, ctx) and (n_decode == n or n * n_head <= 2 * self.n_sm):
                if n_decode == n:                                    # decode rows: the kernel stores k, v itself
                    return self._attention_decode(q, k, v, tabs, positions, ctx)
                self._kv_store(k, v, tabs, positions, ctx)           # few queries of one sequence
                return self._attention_decode(q, None, None, tabs, positions, ctx)
            self._kv_store(k, v, tabs, positions, ctx)
            if batch.is_one_run():
                return self._attention_run(q, tabs, positions, ctx).reshape(n, n_head * d)
            out = cp.empty((n, n_head, d), cp.float32)
            self._attention_plain(q, tabs, positions, out, ctx)
            return out.reshape(n, n_head * d)
        self._kv_store(k, v, tabs, positions, ctx)                 # mixed: decode rows first, then prefill chunks
        out = cp.empty((n, n_head, d), cp.float32)                   # out: [n, n_head, head_dim]
        if n_decode:                                                 # mixed: the decode rows together ...
            rows = slice(0, n_decode)
            if self._decode_fits(n_decode, n_head, ctx):
                out[rows] = self._attention_decode(q[rows], None, None, tabs[rows], positions[rows],
                                                   ctx).reshape(n_decode, n_head, d)
            else:
                self._attention_plain(q[rows], tabs[rows], positions[rows], out[rows], ctx)
        runs = [(a, b) for _, a, b in batch.seq_ranges if a >= n_decode]    # ... then the prefill chunks, together
        self._attention_chunks(q, tabs, positions, out, ctx, runs)
        return out.reshape(n, n_head * d)

    def _paging(self, batch: Batch, cache) -> tuple:
        """-> (tabs, (tables, width, shift, rows)): each row's block-table row on the device, and the paging
        kernels/attention.cu reads keys through. A batch without block tables names each row's one whole-context
        block by its seq_id (a one-entry table each)."""
        bs = cache.block_size
        if batch.block_tables is None:
            return self._dev(batch.seq_ids), (cache.whole_tables, np.int32(1), np.int32(31), np.int32(bs))
        if bs & (bs - 1):
            raise ValueError(f"a paged KV cache needs blocks of a power of two positions, not {bs}")
        return self._dev(batch.table_rows), (self._dev(batch.block_tables), np.int32(batch.block_tables.shape[1]),
                                             np.int32(bs.bit_length() - 1), np.int32(bs))

    @staticmethod
    def _max_keys(ctx) -> int:
        """The most keys a row of the batch can attend to: its table's positions, or the window."""
        window, (_, width, shift, rows) = ctx.window, ctx.paging
        keys = int(rows) if int(shift) == 31 else int(width) * int(rows)
        return min(keys, window) if window else keys

    def _decode_blocks(self, n_head: int, ctx, dk: DecodeKernel | None = None) -> int:
        """Decode attention's blocks per query row (grid y): each KV head's group of query heads, `rows` at a time
        (dk: the kernel, when the caller has it)."""
        n_kv = ctx.cache.k[ctx.layer].shape[2]
        group = n_head // n_kv
        return n_kv * -(-group // (dk or self._decode_kernel(n_head, ctx)).rows)

    def _decode_kernel(self, n_head: int, ctx) -> DecodeKernel:
        n_kv, d = ctx.cache.n_head_kv, ctx.cache.head_dim
        return decode_kernel(self._kv_type(ctx.cache, ctx.layer), d, n_head // n_kv, ctx.softcap)

    def _decode_fits(self, n: int, n_head: int, ctx) -> bool:
        """Whether attention_decode's counters reach n rows' blocks."""
        return n * self._decode_blocks(n_head, ctx) <= ATTENTION_TICKETS

    @staticmethod
    def _kv_type(cache, layer) -> str:
        """The cache's value type as kernels/attention.cu names it (build.KV_TYPES)."""
        return KV_KERNEL_TYPES[cache.k[layer].dtype]

    def _kv_store(self, k, v, tabs, positions, ctx) -> None:
        cache, layer, paging = ctx.cache, ctx.layer, ctx.paging
        n, row = k.shape[0], k.shape[1] * k.shape[2]
        kv_type = self._kv_type(cache, layer)
        kernel("attention", "kv_store_q8_0" if kv_type == "kvq8_0" else f"kv_store<{kv_type}>")(
            ((n * row + 255) // 256,), (256,), (k, v, cache.k[layer], cache.v[layer], tabs, positions, *paging,
                                                np.int32(n), np.int32(row)))

    def _attention_rows(self, q, tabs, positions, ctx):
        """Every row alone over its own keys (batch-invariant mode; k, v stored): attention_decode, whose split
        depends on the row's length only, in launches of at most INVARIANT_ROWS rows, or where it lacks the head
        size the one-warp-per-(row, head) kernel. -> [n, n_head*head_dim]"""
        n, n_head, d = q.shape
        if d > DECODE_HEAD_DIMS[-1]:
            out = cp.empty((n, n_head, d), cp.float32)
            self._attention_plain(q, tabs, positions, out, ctx)
            return out.reshape(n, n_head * d)
        per = max(1, min(INVARIANT_ROWS, ATTENTION_TICKETS // self._decode_blocks(n_head, ctx)))
        if n <= per:
            return self._attention_decode(q, None, None, tabs, positions, ctx)
        return cp.concatenate([self._attention_decode(q[i:i + per], None, None, tabs[i:i + per],
                                                      positions[i:i + per], ctx) for i in range(0, n, per)])

    def _attention_decode(self, q, k, v, tabs, positions, ctx):
        """Few query tokens (decode), flash-decoding over the keys; stores k, v first when given.
        -> [n, n_head*head_dim], with its q8_1 blocks registered for the next mul_mat."""
        cache, layer, scale, window, softcap, paging = ctx
        n, n_head, d = q.shape
        dk = self._decode_kernel(n_head, ctx)
        n_kv, blocks = cache.k[layer].shape[2], self._decode_blocks(n_head, ctx, dk)
        chunk_cap = self._chunk_cap(dk, blocks)
        max_chunks = decode_chunks(self._max_keys(ctx), chunk_cap)
        n_split = max(1, min(max_chunks, -(-DECODE_BLOCKS_PER_SM * self.n_sm // (n * blocks))))
        out = cp.empty((n, n_head, d), cp.float32)
        part = cp.empty((n, n_head, max_chunks, d + 4), cp.float32)  # per chunk: max, sum, -, -, output[head_dim]
        qs, ds, *rs = self._q8_1_planes(n, n_head * d)               # out as q8_1 (and its residual plane)
        h16 = cp.empty((n, n_head * d), cp.float16) if dispatch.writes_f16(n) else None   # and in f16
        none = np.uint64(0)
        launch.with_smem(kernel("attention", dk.name), dk.smem)(
            (n, blocks, n_split), (32, build.constants("attention")["DECODE_WARPS"]),
            (q, cache.k[layer], cache.v[layer], out, tabs, positions, *paging, np.int32(n_head), np.int32(n_kv),
             np.int32(d), np.float32(scale), np.int32(window or 0), np.float32(softcap), part, np.int32(max_chunks),
             np.int32(chunk_cap), self._tickets, qs, ds, rs[0] if rs else none, none if h16 is None else h16,
             *((k, v) if k is not None else (none, none))),
            shared_mem=dk.smem)
        out = out.reshape(n, n_head * d)
        self.acts.put_q8_1(out, (qs, ds, *rs))
        if h16 is not None:
            self.acts.put_f16(out, h16)
        return out

    def _chunk_cap(self, dk: DecodeKernel, blocks: int) -> int:
        """The most chunks a sequence's keys split into (attention.cu decode_chunk): enough for the blocks of one
        sequence to fill the GPU once, so that a long sequence is read by every multiprocessor; it depends on the
        model and the GPU, never on the batch."""
        if (dk, blocks) not in self._chunk_caps:
            c = build.constants("attention")
            per_sm = launch.resident_blocks(kernel("attention", dk.name), 32 * c["DECODE_WARPS"], dk.smem)
            self._chunk_caps[dk, blocks] = max(1, min(c["DECODE_MAX_CHUNKS"], per_sm * self.n_sm // blocks))
        return self._chunk_caps[dk, blocks]

    @staticmethod
    def _q8_1_planes(rows: int, d: int) -> tuple:
        """Buffers for the q8_1 blocks of a [rows, d] activation a kernel writes for the next mul_mat: (qs, ds), and
        the residual plane rs where those rows are multiplied on 16-bit activations (dispatch.residual_rows)."""
        q8 = (cp.empty((rows, d), cp.int8), cp.empty((rows, d // 8), cp.float32))
        return q8 + (cp.empty((rows, d), cp.int8),) if dispatch.residual_rows(rows) else q8

    def _attention_plain(self, q, tabs, positions, out, ctx) -> None:
        cache, layer, scale, window, softcap, paging = ctx
        n, n_head, d = q.shape
        kernel("attention", f"attention<{self._kv_type(cache, layer)}, {attention_head_chunks(d)}, "
                            f"{'true' if softcap else 'false'}>")(
            (n, n_head), (32,), (q, cache.k[layer], cache.v[layer], out, tabs, positions, *paging, np.int32(n_head),
                                 np.int32(cache.k[layer].shape[2]), np.int32(d), np.float32(scale),
                                 np.int32(window or 0), np.float32(softcap)))

    def _attention_run(self, q, tabs, positions, ctx):
        """Query tokens of one sequence at consecutive positions (a prefill chunk) -> [n, n_head, head_dim]."""
        n, n_head, d = q.shape
        out = cp.empty((n, n_head, d), cp.float32)
        if d not in PREFILL_HEAD_DIMS or n == 1:
            self._attention_plain(q, tabs, positions, out, ctx)
        else:
            self._attention_tiled(q, tabs, positions, out, ctx, None)
        return out

    def _attention_chunks(self, q, tabs, positions, out, ctx, runs) -> None:
        """The prefill chunks of several sequences in one launch, into out: runs (a, b) are rows a..b-1 of q, one
        sequence's queries at consecutive positions each, and together rows runs[0][0]..n."""
        first = runs[0][0]
        if q.shape[2] not in PREFILL_HEAD_DIMS:
            self._attention_plain(q[first:], tabs[first:], positions[first:], out[first:], ctx)
        else:
            rows = launch.prefill_rows(self._kv_type(ctx.cache, ctx.layer) == "u16")
            self._attention_tiled(q, tabs, positions, out, ctx, launch.prefill_tiles(runs, rows))

    def _attention_tiled(self, q, tabs, positions, out, ctx, tiles) -> None:
        """The tiled prefill kernel over q's rows into out: on f16 tensor cores for an f16 cache, else SIMT; one block
        per tile of `tiles` (launch.prefill_tiles) and head, or with tiles None all n rows one sequence's."""
        cache, layer, scale, window, softcap, paging = ctx
        n, n_head, d = q.shape
        mma = self._kv_type(cache, layer) == "u16"
        blocks = -(-n // launch.prefill_rows(mma)) if tiles is None else len(tiles)
        pargs = (q, cache.k[layer], cache.v[layer], out, tabs, positions, *paging,
                 np.uint64(0) if tiles is None else self._dev(tiles), np.int32(n), np.int32(n_head),
                 np.int32(cache.k[layer].shape[2]), np.float32(scale), np.int32(window or 0), np.float32(softcap))
        if mma:
            launch.attention_prefill_mma(d, (blocks, n_head), pargs)
        else:
            launch.attention_prefill_simt(self._kv_type(cache, layer), d, (blocks, n_head), pargs)

    def swiglu(self, gate, up):
        return self._glu_act(_swiglu, _swiglu_f16, gate, up)

    def geglu(self, gate, up):
        return self._glu_act(_geglu, _geglu_f16, gate, up)

    def _glu_act(self, plain, with_f16, gate, up):
        """act(gate) * up, with its f16 form registered for the next mul_mat where dispatch.writes_f16."""
        if gate.ndim != 2 or not dispatch.writes_f16(gate.shape[0]):
            return plain(gate, up)
        y, h = with_f16(gate, up)
        self.acts.put_f16(y, h)
        return y

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
