"""The shapes of the steps replayed as CUDA graphs: every step a server can run pads to a graph its warm-up
captured."""
import pytest

from engine.backends.step_shapes import (DECODE_BUCKETS, MAX_DECODE_BATCH, MAX_MIXED_PREFILL, MAX_MIXED_ROWS,
                                         ROW_BUCKETS, bucket, decode_bucket, mixed_logit_rows, warm_up_shapes)


def graph_key(n_decode: int, n_prefill: int, n_prefill_seqs: int) -> tuple:
    """(kind, rows, logit rows) of the graph a step of n_decode decode rows beside n_prefill prefill rows (of
    n_prefill_seqs sequences, each wanting its last logits) replays."""
    if n_prefill == 0:
        return "decode", decode_bucket(n_decode), decode_bucket(n_decode)
    rows = bucket(n_decode + n_prefill, ROW_BUCKETS)
    return "mixed", rows, mixed_logit_rows(rows, n_decode + n_prefill_seqs)


@pytest.mark.parametrize("n_seq,max_rows", [(1, 512), (2, 512), (4, 512), (13, 96), (50, 512), (64, 512), (64, 100)])
def test_warm_up_reaches_every_graph_a_server_steps(n_seq, max_rows):
    """Every step of n_decode decode rows beside prefill chunks of other sequences (each at least one token and
    wanting its logits) within the budget replays a warmed graph, or runs eagerly by rule (a lone sequence's
    prefill, over MAX_MIXED_PREFILL prefill rows or MAX_MIXED_ROWS rows)."""
    shapes = warm_up_shapes(n_seq, max_rows)
    assert all(d + p <= max_rows and (p == 0 or d + 1 <= n_seq) for d, p in shapes)
    warmed = {graph_key(d, p, 1 if p else 0) for d, p in shapes}
    for n_decode in range(n_seq + 1):
        for n_seqs in range(n_seq - n_decode + 1):
            if n_decode + n_seqs == 0 or (n_decode == 0 and n_seqs == 1):
                continue
            for n_prefill in ([0] if n_seqs == 0 else range(n_seqs, MAX_MIXED_PREFILL + 1)):
                rows = n_decode + n_prefill
                if rows > min(max_rows, MAX_MIXED_ROWS):
                    continue
                if n_prefill == n_seqs:          # decode rows and one-token chunks: a decode step's shape
                    key = graph_key(rows, 0, 0)
                else:
                    key = graph_key(n_decode, n_prefill, n_seqs)
                assert key in warmed, (n_decode, n_prefill, n_seqs)


def test_mixed_logit_rows_pad_to_one_size_per_row_bucket():
    for rows in ROW_BUCKETS:
        sizes = {mixed_logit_rows(rows, n_out) for n_out in range(1, min(rows, MAX_DECODE_BATCH) + 1)}
        assert sizes == {min(rows, MAX_DECODE_BATCH)}
        assert all(mixed_logit_rows(rows, n) >= n for n in range(1, rows + 1))
    assert DECODE_BUCKETS[-1] == MAX_DECODE_BATCH
