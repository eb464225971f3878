"""The tokenizers' piece cache (engine/piece_cache.py): reusing a kept text's pieces up to a few before where two texts
part gives the pieces of splitting the whole text, for every pre-tokenizer and SPM's word starts."""
import random

import pytest

from engine import piece_cache
from engine.piece_cache import PieceCache, common_prefix_length
from engine.tokenizer import PRE_TOKENIZERS, SPACE, SPM_WORD_START, _regex_split, _splitter

# runs of whitespace with and without newlines (the pieces whose end looks furthest ahead), punctuation and digit
# runs, contractions, letters of several scripts
ALPHABET = list("abcXYZ  \n\t\r'0123456789.,!?$+<=>^~|_-\u00e9\u00df\u4e2d\u6587\U0001f642") + \
    ["'s", "'LL", "\r\n", "    ", "\n\n", " \n ", "\n  \n", "...", "1234567"]


def random_text(rng, n):
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def check_against_whole_splits(split, make_text, monkeypatch):
    """Texts that share random prefixes with kept ones: the cache's pieces equal split(text)."""
    monkeypatch.setattr(piece_cache, "LONG_TEXT_CHARS", 1)        # every text is kept and reused
    rng = random.Random()
    as_ids = lambda piece: [piece]                                 # noqa: E731 (the pieces themselves as ids)
    reused = 0
    for _ in range(300):
        cache = PieceCache()
        base = make_text(rng, rng.randint(0, 80))
        assert cache.tokenize(base, split, as_ids) == split(base)
        for _ in range(5):
            cut = rng.randint(0, len(base))
            text = base[:cut] + make_text(rng, rng.randint(0, 30))
            reused += len(cache._reuse(text)[2]) > 0
            assert cache.tokenize(text, split, as_ids) == split(text), (base, text)
    assert reused > 300                                            # the reuse path ran, not only whole splits


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_reused_pieces_equal_the_whole_split(pre, monkeypatch):
    splitters = [_splitter(p) for p in PRE_TOKENIZERS[pre]]
    check_against_whole_splits(lambda t: _regex_split(t, splitters), random_text, monkeypatch)


def test_reused_spm_words_equal_the_whole_split(monkeypatch):
    spm_text = lambda rng, n: random_text(rng, n).replace(" ", SPACE) + SPACE * rng.randint(0, 2)  # noqa: E731
    check_against_whole_splits(SPM_WORD_START.split, spm_text, monkeypatch)


def test_only_long_texts_are_kept_and_the_most_recent():
    cache = PieceCache()
    split = lambda t: t.split(" ")                                  # noqa: E731
    cache.tokenize("short text", split, lambda p: [p])
    assert not cache._texts
    texts = [f"{i} " + "word " * 400 for i in range(piece_cache.KEPT_TEXTS + 2)]
    for t in texts:
        cache.tokenize(t, split, lambda p: [p])
    assert list(cache._texts) == texts[2:]


def test_common_prefix_length():
    rng = random.Random()
    for _ in range(500):
        a = random_text(rng, rng.randint(0, 50))
        b = a[:rng.randint(0, len(a))] + random_text(rng, rng.randint(0, 5))
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix_length(a, b) == n
