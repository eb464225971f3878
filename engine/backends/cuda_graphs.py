"""Forward passes replayed as CUDA graphs.

Decode steps (1..MAX_DECODE_BATCH sequences, one token each, every row's logits) get one graph per batch-size bucket
(DECODE_BUCKETS), captured at its first step; a step of fewer sequences than its bucket is padded with rows that
write the KV cache's spare slot (cache.pad_slot) and whose logits are dropped. Prefill ubatches of one sequence (at
least MIN_PREFILL tokens at consecutive positions, the last token's logits or none) get one graph per length,
captured the second time that length comes (the ubatch size of a long prompt, a benchmark's prompt; the
MAX_PREFILL_GRAPHS most recent kept). CuPy refuses its own cuBLAS wrappers during a capture: launch.gemm_xwt then
calls cublasGemmEx through ctypes (cuda/cublas_capture.py). Should a capture fail anyway, steps of that kind run
eagerly from then on (a model's prefill, after one failure).

A capture first runs the step eagerly (compiling and loading kernels; its result is returned), then captures the same
step; later steps copy their tokens, positions and sequence slots into the graph's input buffer and replay it. Every
kernel reads positions and slots from device memory, so one graph serves every step of its shape. The arrays a capture
allocates come from a memory pool of the graph's own, which nothing else uses, so their addresses stay valid.
ENGINE_CUDA_GRAPHS=0 turns graphs off.
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict, defaultdict
from dataclasses import dataclass

import cupy as cp
import numpy as np

from .base import Batch

# Up to 64 columns every weight type of the test and benchmark models takes MMVQ or MMQ (cuda/dispatch.py); above,
# some take dequantize + cuBLAS, whose f16 copy of a weight would live in each graph's memory pool.
DECODE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
MAX_DECODE_BATCH = DECODE_BUCKETS[-1]
MIN_PREFILL = 64
MAX_PREFILL_GRAPHS = 4


@dataclass
class CapturedStep:
    """A captured step and every buffer it reads or writes outside its own pool (held: the graph has their
    addresses)."""
    graph: object          # cupy.cuda.Graph
    inputs: cp.ndarray     # [3, n] int32: tokens, positions, sequence slots
    rows: cp.ndarray       # [n_out] int32: the logit rows
    logits: object         # [n_out, n_vocab] f32 written by every replay (None: a ubatch that only fills the cache)
    pool: cp.cuda.MemoryPool
    owners: tuple          # (model, cache): kept alive, so their ids (the key) are not reused


def graphs_enabled() -> bool:
    return os.environ.get("ENGINE_CUDA_GRAPHS", "1") != "0"


def decode_bucket(n: int) -> int:
    """The graph batch size a decode step of n sequences is padded to."""
    return next(b for b in DECODE_BUCKETS if b >= n)


def step_kind(batch: Batch) -> str | None:
    """"decode", "last" (a prefill ubatch wanting its last logits), "fill" (one only filling the cache), or None."""
    n, rows = len(batch.tokens), batch.logit_rows
    if 0 < n <= MAX_DECODE_BATCH and len(batch.seq_ranges) == n and len(rows) == n and \
            bool(np.all(rows == np.arange(n))):
        return "decode"
    if n >= MIN_PREFILL and batch.is_one_run():
        if len(rows) == 0:
            return "fill"
        if len(rows) == 1 and rows[0] == n - 1:
            return "last"
    return None


class StepGraphs:
    def __init__(self, backend):
        self.backend = backend
        self.decode: dict[tuple, CapturedStep | None] = {}
        self.prefill: OrderedDict[tuple, CapturedStep] = OrderedDict()
        self.seen: defaultdict[tuple, int] = defaultdict(int)
        self.no_prefill: set[int] = set()      # ids of models whose prefill capture failed
        self.replays = 0
        self.failures = 0

    def run(self, model, batch: Batch, cache):
        """-> logits [n_out, n_vocab] (a graph's buffer, overwritten by its next replay: copy it out first)."""
        kind = step_kind(batch)
        if kind is None or (kind != "decode" and id(model) in self.no_prefill):
            return self._eager(model, batch, cache)
        n = len(batch.tokens)
        host = np.stack([batch.tokens, batch.positions, batch.seq_ids]).astype(np.int32)   # [3, n]
        logit_rows = batch.logit_rows
        if kind == "decode" and cache.pad_slot is not None and decode_bucket(n) > n:
            pad = decode_bucket(n) - n                                   # rows writing the spare slot at position 0
            host = np.concatenate([host, np.array([[0] * pad, [0] * pad, [cache.pad_slot] * pad], np.int32)], 1)
            logit_rows = np.arange(n + pad, dtype=np.int32)
        key = (id(model), id(cache), kind, host.shape[1])
        table = self.decode if kind == "decode" else self.prefill
        if key not in table:
            self.seen[key] += 1
            if kind != "decode" and self.seen[key] < 2:
                return self._eager(model, batch, cache)
            logits, step = self._capture(model, cache, host, logit_rows)
            if kind == "decode":
                table[key] = step
            elif step is None:
                self.no_prefill.add(id(model))
            else:
                table[key] = step
                if len(table) > MAX_PREFILL_GRAPHS:
                    table.popitem(last=False)
            return logits[:n] if kind == "decode" else logits
        step = table[key]
        if step is None:                                      # its capture failed: eager from now on
            return self._eager(model, batch, cache)
        if kind != "decode":
            table.move_to_end(key)
        stream = self.backend.stream
        step.inputs.set(host, stream=stream)
        step.graph.launch(stream=stream)
        self.replays += 1
        return step.logits[:n] if kind == "decode" else step.logits

    def _eager(self, model, batch, cache):
        with self.backend.stream:
            return model.forward(batch, cache)

    def _capture(self, model, cache, host: np.ndarray, logit_rows: np.ndarray):
        B, stream = self.backend, self.backend.stream
        pool = cp.cuda.MemoryPool()
        with stream:
            inputs = cp.asarray(host)                                         # [3, n] int32
            rows = cp.asarray(logit_rows.astype(np.int32))                    # [n_out] int32
        stream.synchronize()
        batch = Batch.make(host[0], host[1], host[2], logit_rows)
        for arr, dev in ((batch.tokens, inputs[0]), (batch.positions, inputs[1]), (batch.seq_ids, inputs[2]),
                         (batch.logit_rows, rows)):
            B.bind(arr, dev)
        try:
            with stream, cp.cuda.using_allocator(pool.malloc):
                eager = model.forward(batch, cache)                           # this step's result
                B.acts.clear()
                stream.synchronize()
                try:
                    stream.begin_capture()
                    try:
                        logits = model.forward(batch, cache)
                    finally:
                        graph = stream.end_capture()
                    graph.upload(stream)
                except Exception as e:                                        # this shape runs eagerly from now on
                    if not self.failures:
                        print(f"engine: a CUDA graph capture failed ({len(host[0])} tokens); such steps run "
                              f"eagerly: {e}", file=sys.stderr)
                    self.failures += 1
                    return eager, None
                finally:
                    B.acts.clear()
        finally:
            B.unbind()
        return eager, CapturedStep(graph, inputs, rows, logits, pool, (model, cache))
