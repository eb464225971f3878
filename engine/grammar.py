"""Structured output: grammars (JSON schemas, any JSON object, GBNF, Lark) compiled by llguidance, and a per-sequence
constraint that masks the tokens the grammar does not allow at each step.

    grammar = compile_grammar(json_schema={"type": "object", ...})   # a grammar string; GrammarError if invalid
    c = Constraint(grammar_tokenizer(tokenizer, n_vocab), grammar, n_vocab)
    allowed = c.allowed()           # bool [n_vocab]: the tokens that keep the output inside the grammar
    c.consume(token)                # after sampling; c.done once the grammar accepts nothing more

The tokenizer llguidance needs is built once per vocabulary (grammar_tokenizer caches it): each token's bytes, control
and user-defined tokens marked as special (a 0xff prefix, as llguidance's llama.cpp adapter does), the end-of-generation
tokens as its EOS, and the engine's own encoder for the text it tokenizes itself.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict

import numpy as np

from .tokenizer import CONTROL, USER_DEFINED, Tokenizer

MAX_GRAMMAR_CHARS = 1 << 20      # a schema or grammar text at most this long (the request body's bound is larger)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}   # one line, as json.dumps


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile (a client error)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:    # pragma: no cover - a dependency of the package
        raise GrammarError(f"structured output needs llguidance (pip install llguidance): {e}") from None
    return llguidance


def compile_grammar(json_schema: dict | bool | None = None, json_object: bool = False, gbnf: str | None = None,
                    lark: str | None = None) -> str:
    """The llguidance grammar for exactly one of: a JSON schema, any JSON object, a GBNF grammar (llama-server's
    `grammar`), a Lark grammar. Validated here: GrammarError names what is wrong."""
    ll = _llguidance()
    given = [x is not None for x in (json_schema, gbnf, lark)] + [json_object]
    if sum(given) != 1:
        raise GrammarError("give one of a JSON schema, json_object, a GBNF or a Lark grammar")
    try:
        if json_object:
            grammar = ll.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_STYLE)
        elif json_schema is not None:
            if not isinstance(json_schema, (dict, bool)):
                raise GrammarError("the JSON schema is not an object")
            if len(json.dumps(json_schema)) > MAX_GRAMMAR_CHARS:
                raise GrammarError(f"the JSON schema is longer than {MAX_GRAMMAR_CHARS} characters")
            grammar = ll.LLMatcher.grammar_from_json_schema(json_schema, defaults=JSON_STYLE)
        else:
            text = gbnf if gbnf is not None else lark
            if not isinstance(text, str) or not text.strip():
                raise GrammarError("the grammar is empty or not a string")
            if len(text) > MAX_GRAMMAR_CHARS:
                raise GrammarError(f"the grammar is longer than {MAX_GRAMMAR_CHARS} characters")
            if gbnf is not None:
                from llguidance.gbnf_to_lark import gbnf_to_lark
                text = gbnf_to_lark(text)
            grammar = ll.LLMatcher.grammar_from_lark(text)
    except GrammarError:
        raise
    except Exception as e:       # llguidance's ValueError / its GBNF converter's errors
        raise GrammarError(f"invalid grammar: {_one_line(e)}") from None
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise GrammarError(f"invalid grammar: {_one_line(messages[0] if messages else 'unknown error')}")
    return grammar


def _one_line(e) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 300 else text[:297] + "..."


ENCODE_CACHE_SIZE = 1 << 16     # texts whose token ids _Encoder keeps


class _Encoder:
    """What llguidance's TokenizerWrapper reads: token bytes, special ids, EOS / BOS, and text -> ids."""

    def __init__(self, tok: Tokenizer):
        self.tokens = []
        self.special_token_ids = []
        for tid in range(tok.n_vocab):
            b = tok.token_bytes(tid, special=True)
            if tok.types[tid] == CONTROL or (tok.types[tid] == USER_DEFINED and b[:1] == b"<" and b[-1:] == b">"):
                b = b"\xff" + b
                self.special_token_ids.append(tid)
            self.tokens.append(b)
        self.eos_token_id = sorted(tok.eog_ids)[0] if tok.eog_ids else tok.eos_id
        self.bos_token_id = tok.bos_id
        self._tok = tok
        self._seen: dict[str, list[int]] = {}      # text -> ids: llguidance asks for the same few strings again and
                                                   # again while it computes masks (a JSON schema's keys and quotes)

    def __call__(self, text):
        if not isinstance(text, str):
            raise TypeError("text, not bytes")
        ids = self._seen.get(text)
        if ids is None:
            if len(self._seen) >= ENCODE_CACHE_SIZE:
                self._seen.clear()
            ids = self._seen[text] = self._tok.encode(text, add_special=False, parse_special=False)
        return list(ids)


_cache: dict[tuple[int, int], tuple[Tokenizer, object]] = {}
_cache_lock = threading.Lock()


def grammar_tokenizer(tok: Tokenizer, n_vocab: int | None = None):
    """llguidance's LLTokenizer for this vocabulary, n_vocab tokens (the model's logits; ids past the tokenizer's
    are never allowed); built once (0.2 s for SmolLM2's 49k tokens)."""
    n_vocab = n_vocab or tok.n_vocab
    with _cache_lock:
        hit = _cache.get((id(tok), n_vocab))
        if hit is None or hit[0] is not tok:
            ll = _llguidance()
            eog = sorted(tok.eog_ids) or ([tok.eos_id] if tok.eos_id is not None else None)
            hit = (tok, ll.LLTokenizer(ll.TokenizerWrapper(_Encoder(tok)), n_vocab=n_vocab, eos_token=eog))
            _cache[(id(tok), n_vocab)] = hit
        return hit[1]


_executor = None


def batch_masks(constraints: list) -> np.ndarray:
    """The next-token masks of several Constraints of one vocabulary, computed in parallel by llguidance's thread
    pool -> int32 [len(constraints), words]: bit i % 32 of word i // 32 set where token i is allowed."""
    global _executor
    words = constraints[0]._words
    if any(c._words != words for c in constraints):
        raise ValueError("batch_masks: constraints of different vocabularies")
    if _executor is None:
        _executor = _llguidance().LLExecutor()
    out = np.full((len(constraints), words), -1, np.int32)
    _executor.unsafe_compute_mask_ptr([(c.matcher, j) for j, c in enumerate(constraints)], out.ctypes.data,
                                      words * 4, len(constraints))
    return out


def any_allowed(masks: np.ndarray, n_vocab: int) -> np.ndarray:
    """bool [R]: whether int32 masks [R, words] allow any of the first n_vocab tokens."""
    full, rest = divmod(n_vocab, 32)
    some = masks[:, :full].any(axis=1)
    if rest:
        some |= (masks[:, full].view(np.uint32) & np.uint32((1 << rest) - 1)) != 0
    return some


def mask_flags(masks: np.ndarray, n_vocab: int) -> np.ndarray:
    """int32 masks [R, words] -> bool [R, n_vocab], one flag per token."""
    return np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, :n_vocab].astype(bool)


TEMPLATES = 64             # grammars whose fresh matcher is kept to copy (a server sees the same few schemas)
_templates: OrderedDict = OrderedDict()     # (id(tokenizer), grammar) -> (tokenizer, fresh matcher), oldest first


def _fresh_matcher(ll_tokenizer, grammar: str):
    """A matcher at the start of grammar: a copy of the one kept for it (deep_copy takes ~1 us and shares the
    warmed lexer; a new LLMatcher takes ~1.1 ms and its first mask ~0.27 ms, on the CPU machine)."""
    key = (id(ll_tokenizer), grammar)
    with _cache_lock:
        hit = _templates.get(key)
        if hit is not None and hit[0] is ll_tokenizer:
            _templates.move_to_end(key)
            return hit[1].deep_copy()
    matcher = _llguidance().LLMatcher(ll_tokenizer, grammar, log_level=0)
    if matcher.is_error():
        return matcher
    bits = np.empty((ll_tokenizer.vocab_size + 31) // 32, np.int32)
    matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)      # warms the lexer the copies share
    with _cache_lock:
        _templates[key] = (ll_tokenizer, matcher)
        while len(_templates) > TEMPLATES:
            _templates.popitem(last=False)
    return matcher.deep_copy()


class Constraint:
    """One sequence's grammar state: the tokens allowed next, advanced by each sampled token."""

    def __init__(self, ll_tokenizer, grammar: str, n_vocab: int):
        self.matcher = _fresh_matcher(ll_tokenizer, grammar)
        if self.matcher.is_error():
            raise GrammarError(f"invalid grammar: {_one_line(self.matcher.get_error())}")
        self.n_vocab = n_vocab                  # the logits' (llguidance adds an EOS token to a vocabulary without)
        self._words = (ll_tokenizer.vocab_size + 31) // 32
        self._bits = np.full(self._words, -1, np.int32)              # [ceil(n_vocab / 32)] int32 bitmask

    def allowed(self) -> np.ndarray:
        """bool [n_vocab]: the tokens that keep the output inside the grammar (end-of-generation once complete)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        return mask_flags(self._bits[None], self.n_vocab)[0]

    def consume(self, token: int) -> None:
        """Advance past a sampled token; GrammarError if the grammar did not allow it."""
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"the grammar did not allow token {token}: {_one_line(self.matcher.get_error())}")

    @property
    def done(self) -> bool:
        """The grammar accepts no further token (the output is complete)."""
        return self.matcher.is_stopped()
