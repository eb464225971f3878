"""The pieces of the most recent long texts a tokenizer split, and their ids, so that a text that starts like one of
them (a system prompt or a whole conversation sent again, as chat clients and agents do every turn) is split and
merged only from a few pieces before where the two texts part.

Why reusing those pieces is exact: a pre-tokenizer splits a text in one left-to-right scan (BPE's regexes, none with
a lookbehind or an anchor; SPM's word starts, which look one character either side), so the pieces from a piece
boundary on are the split of the text from that boundary. Where a piece ends depends on the text up to at most the
run of whitespace after it and the character after that run (`\\s+(?!\\S)`, `\\s*[\\r\\n]+`), which the next two
pieces hold: the pieces ending REUSE_MARGIN pieces before the first character where two texts differ are the same in
both. tests/test_piece_cache.py checks this against splitting whole texts for every pre-tokenizer and SPM's word
starts, tests/test_tokenizer.py on the real tokenizers.
"""
from __future__ import annotations

import threading
from bisect import bisect_right
from collections import OrderedDict
from itertools import accumulate, chain
from typing import Callable

LONG_TEXT_CHARS = 1024   # texts at least this long keep their pieces
KEPT_TEXTS = 8           # ... the most recent this many
REUSE_MARGIN = 3         # pieces before the first difference split again: one more than the two a piece's end can
                         # depend on (tests/test_piece_cache.py fails at 1)


def common_prefix_length(a: str, b: str) -> int:
    """How many leading characters a and b share (a bisection of slice comparisons: C speed on long texts)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:                      # a[:lo] == b[:lo], a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PieceCache:
    """tokenize(text, split, piece_ids): the ids of split(text)'s pieces, each piece's ids from piece_ids, reusing
    the pieces of the kept text sharing the longest prefix with text. Thread-safe (a server's tokenizer threads)."""

    def __init__(self):
        self._lock = threading.Lock()
        # text -> (each piece's end offset, ids up to each piece's end, the ids)
        self._texts: OrderedDict[str, tuple[list[int], list[int], list[int]]] = OrderedDict()

    def tokenize(self, text: str, split: Callable[[str], list[str]], piece_ids: Callable[[str], list[int]]) -> list[int]:
        if len(text) < LONG_TEXT_CHARS:
            return list(chain.from_iterable(map(piece_ids, split(text))))
        ends, counts, ids = self._reuse(text)
        start = ends[-1] if ends else 0
        pieces = split(text[start:])
        new = [piece_ids(p) for p in pieces]
        ends = ends + list(accumulate(map(len, pieces), initial=start))[1:]
        counts = counts + list(accumulate(map(len, new), initial=len(ids)))[1:]
        ids = ids + list(chain.from_iterable(new))
        with self._lock:
            self._texts[text] = (ends, counts, ids)
            self._texts.move_to_end(text)
            while len(self._texts) > KEPT_TEXTS:
                self._texts.popitem(last=False)
        return list(ids)

    def _reuse(self, text: str) -> tuple[list[int], list[int], list[int]]:
        """The kept pieces text can start with: (their ends, ids up to each, the ids), those of the kept text
        sharing the longest prefix with text, up to REUSE_MARGIN pieces before the first difference."""
        with self._lock:
            best, shared = None, 0
            for kept, entry in self._texts.items():
                n = common_prefix_length(text, kept)
                if n > shared:
                    best, shared = entry, n
        if best is None:
            return [], [], []
        ends, counts, ids = best
        keep = bisect_right(ends, shared) - REUSE_MARGIN
        if keep <= 0:
            return [], [], []
        return ends[:keep], counts[:keep], ids[:counts[keep - 1]]
