"""Forward passes replayed as CUDA graphs.

Three kinds of step are captured, each keyed by its shape; a later step of the same key copies its tokens, positions
and each row's block-table row (and the block tables, and logit rows) into the graph's input buffers and replays it.
Every kernel reads positions and tables from device memory, so one graph serves every step of its shape: a runtime's
tables are all as wide as a sequence's context (Batch.make's width). A cache of one whole-context block per sequence
has no tables: the rows name their blocks (seq_ids).

- decode: 1..MAX_DECODE_BATCH sequences, one token each, every row's logits; one graph per batch-size bucket
  (DECODE_BUCKETS), captured at its first step. A step of fewer sequences than its bucket is padded with rows that
  write the KV cache's spare block (cache.pad_slot; their table rows hold only it) and whose logits are dropped.
- mixed: decode rows beside short prefill chunks (a server's step: at most MAX_MIXED_ROWS rows, MAX_MIXED_PREFILL of
  them prefill), one graph per row bucket (ROW_BUCKETS), padded likewise; its logit rows are padded to
  mixed_logit_rows() (extra rows repeat the last), so one graph serves every step of that many rows. Attention then
  takes every row as its own query over the cache (Batch.per_row), so the launches depend on the row count alone.
- A server captures every decode and mixed graph it can reach before its first request (warm_up_shapes()).
- prefill: ubatches of one sequence (at least MIN_PREFILL tokens at consecutive positions, the last token's logits
  or none), one graph per length, captured the second time that length comes (the ubatch size of a long prompt, a
  client's repeated prompt length; the MAX_PREFILL_GRAPHS most recent kept). Their kernels are the eager step's.

CuPy refuses its own cuBLAS wrappers during a capture: launch.gemm_xwt then calls cublasGemmEx through ctypes
(cuda/cublas_capture.py). Should a capture fail anyway, steps of that key run eagerly from then on (a model's
prefill, after one failure).

A capture first runs the step eagerly (compiling and loading kernels; its result is returned), then captures the same
step. The arrays captures allocate come from one memory pool of the graphs' own, which nothing else uses: replays run
one at a time on the backend's stream, so the graphs share their scratch memory, and the buffers a graph keeps (its
logits) stay allocated. CudaConfig(graphs=False) (`--eager`) turns graphs off.

On sm_90 and later a captured graph's edges into the project's kernels become programmatic before it is
instantiated (cuda/pdl.py): each such kernel is launched while the one before it finishes, and waits for it.
"""
from __future__ import annotations

import sys
from collections import Counter, OrderedDict, defaultdict
from dataclasses import dataclass

import cupy as cp
import numpy as np

from ..cuda import config, pdl
from .base import Batch
from .step_shapes import DECODE_BUCKETS, MAX_PREFILL_GRAPHS, ROW_BUCKETS, bucket, mixed_logit_rows, step_kind


@dataclass
class CapturedStep:
    """A captured step and every buffer it reads or writes outside its own pool (held: the graph has their
    addresses)."""
    graph: object          # cupy.cuda.Graph or pdl.ProgrammaticGraph
    inputs: cp.ndarray     # [3, n] int32: tokens, positions, each row's table row (or block: seq_ids)
    tables: cp.ndarray | None   # [rows, width] int32: the block tables (None: whole-context blocks)
    rows: cp.ndarray       # [n_out] int32: the logit rows
    logits: object         # [n_out, n_vocab] f32 written by every replay (None: a ubatch that only fills the cache)
    owners: tuple          # (model, cache): kept alive, so their ids (the key) are not reused


class StepGraphs:
    def __init__(self, backend):
        self.backend = backend
        self.steps: dict[tuple, CapturedStep | None] = {}          # decode and mixed steps (None: capture failed)
        self.prefill: OrderedDict[tuple, CapturedStep] = OrderedDict()
        self.seen: defaultdict[tuple, int] = defaultdict(int)
        self.no_prefill: set[int] = set()      # ids of models whose prefill capture failed
        self.pool: cp.cuda.MemoryPool | None = None                   # every capture's allocations
        self.replays: Counter[str] = Counter()                      # per kind
        self.failures = 0
        self.programmatic_edges = 0                                  # edges pdl.make_programmatic turned, all graphs
        self.pdl = pdl.supported(int(cp.cuda.Device().compute_capability))

    def run(self, model, batch: Batch, cache):
        """-> logits [n_out, n_vocab] (a graph's buffer, overwritten by its next replay: copy it out first)."""
        kind = step_kind(batch)
        padded = kind in ("decode", "mixed")
        if kind is None or (kind == "mixed" and cache.pad_slot is None) or \
                (not padded and id(model) in self.no_prefill):
            return self._eager(model, batch, cache)
        n, n_out = len(batch.tokens), len(batch.logit_rows)
        paged = batch.block_tables is not None
        host = np.stack([batch.tokens, batch.positions, batch.table_rows if paged else batch.seq_ids]).astype(np.int32)
        tables = batch.block_tables                                      # [3, n] above; [n_tables, width]
        logit_rows = batch.logit_rows
        if padded and cache.pad_slot is not None:
            size = bucket(n, DECODE_BUCKETS if kind == "decode" else ROW_BUCKETS)
            pad = size - n                                               # rows writing the spare block at position 0
            if paged:                                                    # tables past the batch's: the spare block
                tables = np.full((size, tables.shape[1]), cache.pad_slot, np.int32)
                tables[:len(batch.block_tables)] = batch.block_tables
            if pad:
                spare = len(batch.block_tables) if paged else cache.pad_slot
                host = np.concatenate([host, np.array([[0] * pad, [0] * pad, [spare] * pad], np.int32)], 1)
            if kind == "decode":
                logit_rows = np.arange(size, dtype=np.int32)
            else:
                extra = mixed_logit_rows(size, n_out) - n_out
                logit_rows = np.concatenate([logit_rows, np.full(extra, logit_rows[-1], np.int32)])
        key = (id(model), id(cache), kind, host.shape[1], len(logit_rows), None if tables is None else tables.shape)
        table = self.steps if padded else self.prefill
        if key not in table:
            self.seen[key] += 1
            if not padded and self.seen[key] < 2:
                return self._eager(model, batch, cache)
            logits, step = self._capture(model, cache, host, tables, logit_rows, per_row=kind == "mixed")
            if padded:
                table[key] = step
            elif step is None:
                self.no_prefill.add(id(model))
            else:
                table[key] = step
                if len(table) > MAX_PREFILL_GRAPHS:
                    table.popitem(last=False)
            return logits[:n_out] if padded else logits
        step = table[key]
        if step is None:                                      # its capture failed: eager from now on
            return self._eager(model, batch, cache)
        if not padded:
            table.move_to_end(key)
        stream = self.backend.stream
        step.inputs.set(host, stream=stream)
        if tables is not None:
            step.tables.set(tables, stream=stream)
        if kind == "mixed":
            step.rows.set(logit_rows.astype(np.int32), stream=stream)
        step.graph.launch(stream=stream)
        self.replays[kind] += 1
        return step.logits[:n_out] if padded else step.logits

    def _eager(self, model, batch, cache):
        with self.backend.stream:
            return model.forward(batch, cache)

    def _capture(self, model, cache, host: np.ndarray, tables: np.ndarray | None, logit_rows: np.ndarray,
                 per_row: bool = False):
        B, stream = self.backend, self.backend.stream
        if self.pool is None:
            self.pool = cp.cuda.MemoryPool()
        pool = self.pool
        with stream:
            inputs = cp.asarray(host)                                         # [3, n] int32
            dev_tables = None if tables is None else cp.asarray(tables)       # [n_tables, width] int32
            rows = cp.asarray(logit_rows.astype(np.int32))                    # [n_out] int32
        stream.synchronize()
        batch = Batch.make(host[0], host[1], host[2], logit_rows)
        batch.per_row = per_row
        bound = [(batch.tokens, inputs[0]), (batch.positions, inputs[1]), (batch.seq_ids, inputs[2]),
                 (batch.logit_rows, rows)]
        if tables is not None:                          # the rows' table rows are inputs[2]; seq_ids are not read
            batch.block_tables, batch.table_rows = tables, batch.seq_ids
            bound.append((tables, dev_tables))
        for arr, dev in bound:
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
                    if self.pdl and config.current().programmatic_launch:
                        graph = pdl.programmatic_graph(graph)
                        self.programmatic_edges += getattr(graph, "edges", 0)
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
        return eager, CapturedStep(graph, inputs, dev_tables, rows, logits, (model, cache))
