"""The shapes of the steps replayed as CUDA graphs (backends/cuda_graphs.py): their buckets, how a step is padded to
one, which kind of graph a step is, and the steps a server runs ahead of its first request. Plain numpy, so the
rules are tested without a GPU."""
from __future__ import annotations

import numpy as np

from .base import Batch

# Up to 64 columns every weight type of the test and benchmark models takes MMVQ or MMQ (cuda/dispatch.py); above,
# some take dequantize + cuBLAS, whose f16 copy of a weight lives in the graphs' pool (the largest one weight's).
DECODE_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, 48, 56, 64)
ROW_BUCKETS = DECODE_BUCKETS + (80, 96, 112, 128)
MAX_DECODE_BATCH = DECODE_BUCKETS[-1]
MAX_MIXED_ROWS = ROW_BUCKETS[-1]
MAX_MIXED_PREFILL = 64       # a replayed mixed step's prefill rows, each reading its keys alone (no tiling)
MIN_PREFILL = 2
MAX_PREFILL_GRAPHS = 16


def bucket(n: int, buckets: tuple[int, ...] = DECODE_BUCKETS) -> int:
    """The graph size n rows are padded to."""
    return next(b for b in buckets if b >= n)


def decode_bucket(n: int) -> int:
    """The graph batch size a decode step of n sequences is padded to."""
    return bucket(n, DECODE_BUCKETS)


def mixed_logit_rows(rows: int, n_out: int) -> int:
    """The logit rows a mixed step of `rows` rows (a ROW_BUCKETS size) and n_out logits is padded to: one size per
    row bucket while n_out stays within a decode batch (the LM head over a few more rows costs less than a graph
    captured mid-serving)."""
    cap = min(rows, MAX_DECODE_BATCH)
    return cap if n_out <= cap else rows


def warm_up_shapes(n_seq: int, max_rows: int) -> list[tuple[int, int]]:
    """(decode rows, prefill rows) of one step per graph a server with n_seq KV slots (at most MAX_DECODE_BATCH) and
    a step budget of max_rows tokens can reach: every decode bucket up to n_seq sequences (fewer rows pad up), and
    every mixed row bucket (decode rows of distinct slots beside one more sequence's prefill chunk, at most
    MAX_MIXED_PREFILL rows)."""
    shapes = [(min(b, n_seq), 0) for b in DECODE_BUCKETS if b <= decode_bucket(min(n_seq, MAX_DECODE_BATCH))]
    below = 1
    for size in ROW_BUCKETS:
        rows = min(size, max_rows)
        n_decode = min(n_seq - 1, max(1, rows - MAX_MIXED_PREFILL))
        n_prefill = min(MAX_MIXED_PREFILL, rows - n_decode)
        if n_decode >= 1 and n_prefill >= 2 and n_decode + n_prefill > below:
            shapes.append((n_decode, n_prefill))
        below = size
    return shapes


def step_kind(batch: Batch) -> str | None:
    """"decode", "mixed", "last" (a prefill ubatch wanting its last logits), "fill" (one only filling the cache), or
    None (runs eagerly)."""
    n, rows = len(batch.tokens), batch.logit_rows
    if 0 < n <= MAX_DECODE_BATCH and len(batch.seq_ranges) == n and len(rows) == n and \
            bool(np.all(rows == np.arange(n))):
        return "decode"
    if batch.is_one_run():
        if n >= MIN_PREFILL and len(rows) == 0:
            return "fill"
        if n >= MIN_PREFILL and len(rows) == 1 and rows[0] == n - 1:
            return "last"
        return None
    if n <= MAX_MIXED_ROWS and 0 < len(rows) <= MAX_MIXED_ROWS and batch.prefill_rows() <= MAX_MIXED_PREFILL:
        return "mixed"
    return None
