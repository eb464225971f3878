"""Decode steps replayed as CUDA graphs: one graph per batch size (1..MAX_GRAPH_BATCH tokens, one per sequence).

The first step at a batch size runs eagerly (compiling and loading kernels), then the same step is captured; later
steps copy their tokens, positions and sequence slots into the graph's input buffer and replay it. Every kernel reads
positions and slots from device memory, so one graph serves every step. The arrays a capture allocates come from a
memory pool of the graph's own, which nothing else uses, so their addresses stay valid for the replays.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import cupy as cp
import numpy as np

from .base import Batch

MAX_GRAPH_BATCH = 8     # the MMVQ range: larger batches take dequantize+cuBLAS, which runs eagerly


@dataclass
class CapturedStep:
    """A captured decode step and every buffer it reads or writes outside its own pool (held: the graph has their
    addresses)."""
    graph: object          # cupy.cuda.Graph
    inputs: cp.ndarray     # [3, n] int32: tokens, positions, sequence slots
    rows: cp.ndarray       # [n] int32: the logit rows, 0..n-1
    logits: cp.ndarray     # [n, n_vocab] f32, written by every replay
    pool: cp.cuda.MemoryPool
    owners: tuple          # (model, cache): kept alive, so their ids (the key) are not reused


def graphs_enabled() -> bool:
    """ENGINE_CUDA_GRAPHS=0 turns the graphs off (every step eager)."""
    return os.environ.get("ENGINE_CUDA_GRAPHS", "1") != "0"


class DecodeGraphs:
    def __init__(self, backend):
        self.backend = backend
        self.steps: dict[tuple[int, int, int], CapturedStep] = {}
        self.replays = 0
        self.failed = False

    def accepts(self, batch: Batch) -> bool:
        """A decode step: at most MAX_GRAPH_BATCH sequences, one token each, logits for every row."""
        n = len(batch.tokens)
        return (not self.failed and 0 < n <= MAX_GRAPH_BATCH and len(batch.seq_ranges) == n
                and len(batch.logit_rows) == n and bool(np.all(batch.logit_rows == np.arange(n))))

    def run(self, model, batch: Batch, cache):
        """-> logits [n, n_vocab] (a buffer the next replay overwrites: copy it out before the next step)."""
        n = len(batch.tokens)
        key = (id(model), id(cache), n)
        host = np.stack([batch.tokens, batch.positions, batch.seq_ids]).astype(np.int32)   # [3, n]
        step = self.steps.get(key)
        if step is None:
            logits, step = self._capture(model, cache, host)
            if step is not None:
                self.steps[key] = step
            return logits
        stream = self.backend.stream
        step.inputs.set(host, stream=stream)
        step.graph.launch(stream=stream)
        self.replays += 1
        return step.logits

    def _capture(self, model, cache, host: np.ndarray):
        B, stream = self.backend, self.backend.stream
        n = host.shape[1]
        pool = cp.cuda.MemoryPool()
        with stream:
            inputs = cp.asarray(host)                                         # [3, n] int32
            rows = cp.arange(n, dtype=cp.int32)                               # [n] int32
        stream.synchronize()
        batch = Batch.make(host[0], host[1], host[2], np.arange(n))
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
                except Exception as e:                                        # run eagerly from now on
                    print(f"engine: CUDA graph capture failed, decoding without graphs: {e}", file=sys.stderr)
                    self.failed = True
                    return eager, None
                finally:
                    B.acts.clear()
        finally:
            B.unbind()
        return eager, CapturedStep(graph, inputs, rows, logits, pool, (model, cache))
