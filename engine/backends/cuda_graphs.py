"""Decode steps replayed as CUDA graphs: 1..MAX_DECODE_BATCH sequences, one token each, every row's logits; one graph
per batch size, captured at its first step. (Prefill ubatches are not captured: CuPy refuses cuBLAS calls during a
capture, and above 8 tokens every mul_mat on sm_90 is dequantize + cuBLAS.)

A capture first runs the step eagerly (compiling and loading kernels; its result is returned), then captures the same
step; later steps copy their tokens, positions and sequence slots into the graph's input buffer and replay it. Every
kernel reads positions and slots from device memory, so one graph serves every step of its shape. The arrays a capture
allocates come from a memory pool of the graph's own, which nothing else uses, so their addresses stay valid.
ENGINE_CUDA_GRAPHS=0 turns graphs off.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import cupy as cp
import numpy as np

from .base import Batch

MAX_DECODE_BATCH = 8       # the MMVQ range


@dataclass
class CapturedStep:
    """A captured step and every buffer it reads or writes outside its own pool (held: the graph has their
    addresses)."""
    graph: object          # cupy.cuda.Graph
    inputs: cp.ndarray     # [3, n] int32: tokens, positions, sequence slots
    rows: cp.ndarray       # [n] int32: the logit rows, 0..n-1
    logits: cp.ndarray     # [n, n_vocab] f32, written by every replay
    pool: cp.cuda.MemoryPool
    owners: tuple          # (model, cache): kept alive, so their ids (the key) are not reused


def graphs_enabled() -> bool:
    return os.environ.get("ENGINE_CUDA_GRAPHS", "1") != "0"


def is_decode_step(batch: Batch) -> bool:
    n, rows = len(batch.tokens), batch.logit_rows
    return 0 < n <= MAX_DECODE_BATCH and len(batch.seq_ranges) == n and len(rows) == n and \
        bool(np.all(rows == np.arange(n)))


class StepGraphs:
    def __init__(self, backend):
        self.backend = backend
        self.decode: dict[tuple, CapturedStep | None] = {}
        self.replays = 0
        self.failures = 0

    def run(self, model, batch: Batch, cache):
        """-> logits [n_out, n_vocab]; a decode step's are a graph's buffer, overwritten by its next replay."""
        if not is_decode_step(batch):
            return self._eager(model, batch, cache)
        key = (id(model), id(cache), len(batch.tokens))
        host = np.stack([batch.tokens, batch.positions, batch.seq_ids]).astype(np.int32)   # [3, n]
        if key not in self.decode:
            logits, self.decode[key] = self._capture(model, cache, host, batch.logit_rows)
            return logits
        step = self.decode[key]
        if step is None:                                      # its capture failed: eager from now on
            return self._eager(model, batch, cache)
        stream = self.backend.stream
        step.inputs.set(host, stream=stream)
        step.graph.launch(stream=stream)
        self.replays += 1
        return step.logits

    def _eager(self, model, batch, cache):
        with self.backend.stream:
            return model.forward(batch, cache)

    def _capture(self, model, cache, host: np.ndarray, logit_rows: np.ndarray):
        B, stream = self.backend, self.backend.stream
        pool = cp.cuda.MemoryPool()
        with stream:
            inputs = cp.asarray(host)                                         # [3, n] int32
            rows = cp.asarray(logit_rows.astype(np.int32))                    # [n] int32
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
                except Exception as e:                                        # this size runs eagerly from now on
                    print(f"engine: CUDA graph capture failed ({len(host[0])} tokens), running eagerly: {e}",
                          file=sys.stderr)
                    self.failures += 1
                    return eager, None
                finally:
                    B.acts.clear()
        finally:
            B.unbind()
        return eager, CapturedStep(graph, inputs, rows, logits, pool, (model, cache))
