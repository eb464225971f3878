"""Tokenizers built from GGUF metadata alone, reproducing llama.cpp's token for token.

- SPM (`tokenizer.ggml.model = llama`): score-driven bigram merging over UTF-8 characters, byte fallback.
- BPE (`tokenizer.ggml.model = gpt2`): byte-level mapping, pre-tokenizer regexes chosen by `tokenizer.ggml.pre`,
  merges by rank.
- Special tokens (control and user-defined) written in the text are split out first, longest first.
- Chat templates (`tokenizer.chat_template`) rendered with a sandboxed jinja2 set up as the models' own tooling
  renders them (Hugging Face's apply_chat_template): `tojson` as json.dumps (keys in order, no HTML escapes),
  `{% break %}` / `{% continue %}`, `{% generation %}` blocks, raise_exception and strftime_now.
"""
from __future__ import annotations

import codecs
import heapq
import json
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Iterable

import numpy as np
import regex
from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from .gguf import GGUFFile, quoted
from .piece_cache import PieceCache

SPACE = "\u2581"                                  # SPM's space
SPM_WORD_START = regex.compile(f"(?<=[^{SPACE}])(?={SPACE})")     # before a "▁" that follows another character
WORD_CACHE_WORDS = 100_000                        # words whose ids a tokenizer keeps

# token types stored in tokenizer.ggml.token_type
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


# Fill-in-the-middle tokens by their usual texts (StarCoder, Qwen 2.5 Coder, CodeLlama, DeepSeek Coder, Codestral)
FIM_TOKEN_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<PRE>", "▁<PRE>", "<｜fim▁begin｜>", "[PREFIX]"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<SUF>", "▁<SUF>", "<｜fim▁hole｜>", "[SUFFIX]"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<MID>", "▁<MID>", "<｜fim▁end｜>", "[MIDDLE]"),
    "sep": ("<|file_sep|>", "<file_sep>", "<file-sep>"),
}

class TokenizerError(ValueError):
    pass


# ---------------------------------------------------------------------------------------------------------------
# BPE pre-tokenizer regexes, applied in sequence (each splits the pieces of the previous one), by tokenizer.ggml.pre
# ---------------------------------------------------------------------------------------------------------------

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {
    "default": [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"],
    "gpt-2": [_GPT2],
    "smollm": [r"\p{N}", _GPT2],
    "starcoder": [r"\p{N}", _GPT2],
    "llama3": [_LLAMA3],
    "llama-bpe": [_LLAMA3],
    "qwen2": [_QWEN2],
}


def _splitter(pattern: str) -> regex.Pattern:
    """pattern in one capturing group: its split() keeps the matches and the text between them, in one C call."""
    if regex.compile(pattern).groups:
        raise ValueError(f"a pre-tokenizer pattern has a capturing group: {pattern}")
    return regex.compile(f"({pattern})")


def _regex_split(text: str, splitters: list[regex.Pattern]) -> list[str]:
    """text cut at each pattern's matches in turn (each splits the pieces of the previous one); matches and the
    text between them are pieces alike. The matching releases the GIL (str is immutable): the server's tokenizer
    threads split prompts side by side."""
    pieces = [text]
    for pat in splitters:
        pieces = [s for piece in pieces for s in pat.split(piece, concurrent=True) if s]
    return pieces


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible mapping of bytes to printable characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    mapping, extra = {}, 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


# ---------------------------------------------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------------------------------------------

class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary."""

    def __init__(self, gguf: GGUFFile):
        md = gguf.metadata
        self.model = md.get("tokenizer.ggml.model")
        if not isinstance(self.model, str) or self.model not in ("llama", "gpt2"):
            shown = quoted(self.model) if isinstance(self.model, str) else repr(type(self.model).__name__)
            raise TokenizerError(f"{gguf.path}: unsupported tokenizer model {shown} (supported: llama, gpt2)")
        tokens = md.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError(f"{gguf.path}: tokenizer.ggml.tokens is not a list of strings")
        self.tokens: list[str] = tokens
        n = len(self.tokens)
        self.types = self._int_list(gguf, "tokenizer.ggml.token_type", n, NORMAL)
        self.scores = self._float_list(gguf, "tokenizer.ggml.scores", n)
        self.token_to_id = {}
        for i, t in enumerate(self.tokens):
            self.token_to_id.setdefault(t, i)
        self.bos_id = self._token_id(gguf, "bos")
        self.eos_id = self._token_id(gguf, "eos")
        self.fim = {part: self._fim_id(gguf, part) for part in FIM_TOKEN_TEXTS}   # fill-in-the-middle ids or None
        self.eot_id = self._token_id(gguf, "eot")
        self.unk_id = self._token_id(gguf, "unknown")
        self.pad_id = self._token_id(gguf, "padding")
        self.add_bos = self._flag(gguf, "tokenizer.ggml.add_bos_token", self.model == "llama")
        self.add_eos = self._flag(gguf, "tokenizer.ggml.add_eos_token", False)
        self.add_space_prefix = self._flag(gguf, "tokenizer.ggml.add_space_prefix", self.model == "llama")
        self.chat_template = md.get("tokenizer.chat_template")
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise TokenizerError(f"{gguf.path}: tokenizer.chat_template is not a string")
        arch = md.get("general.architecture", "")
        self.architecture = arch if isinstance(arch, str) else ""
        # special tokens split out before tokenizing, longest text first (llama.cpp's order)
        self._specials = sorted((i for i in range(n) if self.types[i] in (CONTROL, USER_DEFINED, UNKNOWN)
                                 and self.tokens[i]), key=lambda i: -len(self.tokens[i]))
        # where to look for them: special texts by their first two characters (one, for one-character texts), their
        # lengths longest first (a vocabulary may hold tens of thousands, Gemma's 31 runs of spaces; _partition tries
        # only those the text holds)
        self._special_rank = {tid: r for r, tid in enumerate(self._specials)}
        self._special_ids: dict[str, list[int]] = {}
        lengths: dict[str, set[int]] = {}
        for tid in self._specials:
            text = self.tokens[tid]
            self._special_ids.setdefault(text, []).append(tid)
            lengths.setdefault(text[:2], set()).add(len(text))
        self._special_lengths = {c: sorted(ls, reverse=True) for c, ls in lengths.items()}
        self.eog_ids = self._end_of_generation_ids()
        if self.model == "gpt2":
            pre = md.get("tokenizer.ggml.pre", "default")
            if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
                shown = quoted(pre) if isinstance(pre, str) else type(pre).__name__
                raise TokenizerError(f"{gguf.path}: unsupported BPE pre-tokenizer '{shown}' "
                                     f"(supported: {', '.join(PRE_TOKENIZERS)})")
            self._patterns = [_splitter(p) for p in PRE_TOKENIZERS[pre]]
            self._ignore_merges = pre in ("llama3", "llama-bpe")
            merges = md.get("tokenizer.ggml.merges")
            if not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
                raise TokenizerError(f"{gguf.path}: BPE vocabulary without a tokenizer.ggml.merges list of strings")
            self._ranks = {}
            for rank, m in enumerate(merges):
                a, _, b = m.partition(" ")
                self._ranks.setdefault((a, b), rank)
            self._b2u = _byte_to_unicode()
            self._u2b = {c: b for b, c in self._b2u.items()}
            self._word_cache: dict[str, list[int]] = {}
        else:
            self._byte_ids = [self.token_to_id.get(f"<0x{b:02X}>") for b in range(256)]
            # SPM merges never join across a "▁" that follows another character unless a token holds such a "▁";
            # the text then splits into words there, each merged alone (and kept): the same ids, computed once per
            # distinct word. Texts holding one of those tokens' text are merged whole.
            self._spm_bridges = [s for s in self.tokens if SPACE in s.lstrip(SPACE)]
            self._word_cache = {}
        self._pieces = PieceCache()          # long texts' pieces, for texts that start alike (a resent prompt)
        # where a special token's text may begin: its first two characters (one for one-character texts), looked
        # ahead at every position (Gemma's runs of spaces start at a double space, not at every space)
        keys = sorted(self._special_lengths, key=lambda k: (-len(k), k))
        self._special_starts = regex.compile("(?=" + "|".join(map(regex.escape, keys)) + ")") if keys else None

    @staticmethod
    def _flag(gguf: GGUFFile, key: str, default: bool) -> bool:
        value = gguf.metadata.get(key, default)
        if not isinstance(value, (bool, int, np.bool_, np.integer)):
            raise TokenizerError(f"{gguf.path}: {key} is not a boolean")
        return bool(value)

    @staticmethod
    def _int_list(gguf: GGUFFile, key: str, n: int, default: int) -> list[int]:
        value = gguf.metadata.get(key)
        if value is None:
            return [default] * n
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "iu" or len(value) != n:
            raise TokenizerError(f"{gguf.path}: {key} is not an integer array of {n} (one per token)")
        return [int(t) for t in value]

    @staticmethod
    def _float_list(gguf: GGUFFile, key: str, n: int) -> list[float]:
        value = gguf.metadata.get(key)
        if value is None:
            return [0.0] * n
        if not isinstance(value, np.ndarray) or value.dtype.kind not in "iuf" or len(value) != n:
            raise TokenizerError(f"{gguf.path}: {key} is not a number array of {n} (one per token)")
        return [float(t) for t in value]

    def _token_id(self, gguf: GGUFFile, which: str) -> int | None:
        key = f"tokenizer.ggml.{which}_token_id"
        value = gguf.metadata.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or \
                not 0 <= int(value) < len(self.tokens):
            shown = int(value) if isinstance(value, (int, np.integer)) else type(value).__name__
            raise TokenizerError(f"{gguf.path}: {key} {shown} is outside the vocabulary (0..{len(self.tokens) - 1})")
        return int(value)

    def _fim_id(self, gguf: GGUFFile, part: str) -> int | None:
        """A fill-in-the-middle token: tokenizer.ggml.fim_<part>_token_id, else one of the usual texts in the
        vocabulary (as llama.cpp looks them up)."""
        tid = self._token_id(gguf, f"fim_{part}")
        if tid is None:
            tid = next((self.token_to_id[t] for t in FIM_TOKEN_TEXTS[part] if t in self.token_to_id), None)
        return tid

    @property
    def n_vocab(self) -> int:
        return len(self.tokens)

    def _end_of_generation_ids(self) -> set[int]:
        ids = {i for i in (self.eos_id, self.eot_id) if i is not None}
        for name in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "<end_of_turn>", "<|end|>", "<eos>"):
            i = self.token_to_id.get(name)
            if i is not None and self.types[i] == CONTROL:
                ids.add(i)
        return ids

    # -- encoding --------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Text -> ids. add_special adds BOS/EOS as the metadata asks; parse_special splits out control tokens
        written in the text (user-defined tokens are always split out, as llama.cpp does)."""
        out: list[int] = []
        if add_special and self.add_bos and self.bos_id is not None:
            out.append(self.bos_id)
        prev_special = True
        for frag in self._partition(text, parse_special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            elif self.model == "llama":
                if self.add_space_prefix and prev_special:
                    frag = " " + frag
                out.extend(self._spm_words(frag.replace(" ", SPACE)))
                prev_special = False
            else:
                out.extend(self._bpe(frag))
        if add_special and self.add_eos and self.eos_id is not None:
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """Split text into raw-text fragments and special token ids, longest special token first."""
        return self._split_out(text, self._specials_in(text), parse_special)

    def _split_out(self, text: str, specials: list[int], parse_special: bool) -> list[str | int]:
        """Split each of `specials` in turn (in _specials' order) out of the text's raw fragments."""
        frags: list[str | int] = [text]
        for tid in specials:
            tok = self.tokens[tid]
            if not parse_special and self.types[tid] != USER_DEFINED:
                continue
            if not any(isinstance(f, str) and tok in f for f in frags):
                continue
            new: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    new.append(f)
                    continue
                parts = f.split(tok)
                for k, part in enumerate(parts):
                    if k:
                        new.append(tid)
                    if part:
                        new.append(part)
            frags = new
        return frags

    def _specials_in(self, text: str) -> list[int]:
        """The special tokens whose text occurs in text, in _specials' order (longest first)."""
        found: set[int] = set()
        index, ids = self._special_lengths, self._special_ids
        if self._special_starts is None:
            return []
        for m in self._special_starts.finditer(text, concurrent=True):     # the GIL released while it scans
            i = m.start()
            for key in (text[i:i + 2], text[i]):
                for n in index.get(key, ()):
                    hit = ids.get(text[i:i + n])
                    if hit is not None:
                        found.update(hit)
        return sorted(found, key=self._special_rank.__getitem__)

    def _spm_words(self, text: str) -> list[int]:
        """_spm over text, word by word where no merge can cross a word's start (see __init__), a word's ids kept (and
        a long text's words, for a text that starts alike: piece_cache.py)."""
        if any(b in text for b in self._spm_bridges):
            return self._spm(text)
        return self._pieces.tokenize(text, SPM_WORD_START.split, lambda word: self._word_ids(word, self._spm))

    def _spm(self, text: str) -> list[int]:
        """llama.cpp's SPM: merge the best-scoring adjacent pair that is a token, until none is left."""
        if not text:
            return []
        sym = list(text)                         # symbol text; "" once merged into its left neighbour
        prev = list(range(-1, len(sym) - 1))
        nxt = list(range(1, len(sym) + 1))
        nxt[-1] = -1
        t2i, scores = self.token_to_id, self.scores
        heap: list[tuple[float, int, int, str]] = []  # (-score, left, right, merged text): best score, then leftmost

        def add(left: int, right: int):
            if left < 0 or right < 0:
                return
            s = sym[left] + sym[right]
            tid = t2i.get(s)
            if tid is None:
                return
            heapq.heappush(heap, (-scores[tid], left, right, s))

        for i in range(1, len(sym)):
            add(i - 1, i)
        while heap:
            _, left, right, s = heapq.heappop(heap)
            if not sym[left] or not sym[right] or sym[left] + sym[right] != s:
                continue
            sym[left], sym[right] = s, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])

        # every merged symbol is a token; a single character that is not one falls back to its bytes
        out: list[int] = []
        i = 0
        while i != -1:
            tid = t2i.get(sym[i])
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_ids[b] for b in sym[i].encode("utf-8") if self._byte_ids[b] is not None)
            i = nxt[i]
        return out

    def _bpe(self, text: str) -> list[int]:
        get = self._word_cache.get
        return self._pieces.tokenize(text, lambda t: _regex_split(t, self._patterns),
                                     lambda w: get(w) or self._word_ids(w, self._bpe_text_word))

    def _bpe_text_word(self, word: str) -> list[int]:
        return self._bpe_word("".join(self._b2u[b] for b in word.encode("utf-8")))

    def _word_ids(self, word: str, merge) -> list[int]:
        """A pre-split word's ids: merge(word), kept for the next time (up to WORD_CACHE_WORDS words)."""
        ids = self._word_cache.get(word)
        if ids is None:
            ids = merge(word)
            if len(self._word_cache) < WORD_CACHE_WORDS:
                self._word_cache[word] = ids
        return ids

    def _bpe_word(self, word: str) -> list[int]:
        """Merge the lowest-ranked adjacent pair (leftmost first) until none has a rank: a heap over the pairs and a
        linked list of symbols, so a long word costs O(n log n), not O(n^2)."""
        t2i = self.token_to_id
        if self._ignore_merges and word in t2i:
            return [t2i[word]]
        sym = list(word)                         # symbol text; "" once merged into its left neighbour
        nxt = list(range(1, len(sym) + 1))
        nxt[-1] = -1
        prev = list(range(-1, len(sym) - 1))
        ranks = self._ranks
        heap: list[tuple[int, int, str, str]] = []      # (rank, left index, left text, right text)

        def push(left: int) -> None:
            right = nxt[left] if left >= 0 else -1
            if right < 0:
                return
            r = ranks.get((sym[left], sym[right]))
            if r is not None:
                heapq.heappush(heap, (r, left, sym[left], sym[right]))

        for i in range(len(sym) - 1):
            push(i)
        while heap:
            _, left, a, b = heapq.heappop(heap)
            right = nxt[left]
            if right < 0 or sym[left] != a or sym[right] != b:
                continue                          # stale: one side was merged since
            sym[left], sym[right] = a + b, ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            push(prev[left])
            push(left)
        out = []
        i = 0
        while i != -1:
            p = sym[i]
            tid = t2i.get(p)
            if tid is not None:
                out.append(tid)
            else:  # llama.cpp's fallback: each byte-character that is a token on its own
                out.extend(t2i[c] for c in p if c in t2i)
            i = nxt[i]
        return out

    # -- decoding --------------------------------------------------------------------------------------------
    def token_bytes(self, tid: int, special: bool = False) -> bytes:
        """The bytes a token stands for; control tokens are empty unless `special`."""
        if not 0 <= tid < len(self.tokens):
            raise TokenizerError(f"token id {tid} is outside the vocabulary (0..{len(self.tokens) - 1})")
        ttype, text = self.types[tid], self.tokens[tid]
        if ttype == CONTROL:
            return text.encode("utf-8") if special else b""
        if ttype == USER_DEFINED or ttype == UNKNOWN:
            return text.encode("utf-8")
        if self.model == "gpt2":
            u2b = self._u2b
            return bytes(u2b[c] for c in text) if all(c in u2b for c in text) else text.encode("utf-8")
        if ttype == BYTE:
            return bytes([int(text[3:5], 16)])
        return text.replace("\u2581", " ").encode("utf-8")

    def decode(self, ids: Iterable[int], special: bool = False) -> str:
        return b"".join(self.token_bytes(t, special) for t in ids).decode("utf-8", errors="replace")

    def stream_decoder(self, special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, special)

    def piece(self, tid: int) -> str:
        return self.token_bytes(tid, special=True).decode("utf-8", errors="replace")

    # -- chat ------------------------------------------------------------------------------------------------
    @property
    def template_source(self) -> str:
        """The chat template apply_chat_template renders: the file's, or its family's built-in one."""
        return self.chat_template or _fallback_template(self.architecture)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            limits: "TemplateLimits | None" = None, tools: list[dict] | None = None,
                            variables: dict | None = None) -> str:
        """Render the GGUF chat template (or a built-in one for templates-less files) for a list of messages (and
        OpenAI tools, for a template that takes them), in a sandbox with a time budget and an output cap
        (TemplateLimits): past either, TokenizerError. variables: more names the template sees (a request's
        chat_template_kwargs, e.g. Qwen 3's enable_thinking); they cannot replace the ones above."""
        taken = set(variables or ()) & set(TEMPLATE_NAMES)
        if taken:
            raise TokenizerError(f"chat template variables cannot replace {', '.join(sorted(taken))}")

        source = self.template_source
        limits = limits or TemplateLimits()
        env = _BoundedSandbox(limits)
        bos = self.tokens[self.bos_id] if self.bos_id is not None and 0 <= self.bos_id < self.n_vocab else ""
        eos = self.tokens[self.eos_id] if self.eos_id is not None and 0 <= self.eos_id < self.n_vocab else ""
        try:
            template = env.from_string(source)
            out, size = [], 0
            extra = dict(variables or {}, **({"tools": tools} if tools is not None else {}))
            for piece in template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                           bos_token=bos, eos_token=eos, **extra):
                size += len(piece)
                env.check(size)
                out.append(piece)
            return "".join(out)
        except TemplateLimitError as e:
            raise TokenizerError(f"chat template stopped: {e}") from None
        except TemplateError as e:
            raise TokenizerError(f"chat template failed: {e}") from None
        except (MemoryError, RecursionError) as e:
            raise TokenizerError(f"chat template stopped: {type(e).__name__}") from None
        except Exception as e:  # errors raised by the template's own code (a bad message list, a type error...)
            raise TokenizerError(f"chat template failed: {type(e).__name__}: {e}") from None

    def chat_prompt_ids(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The token ids of a chat: the template's text (which carries its own BOS, if any) parsed with specials."""
        return self.chat_prompt_ids_from_text(self.apply_chat_template(messages, add_generation_prompt))

    def chat_prompt_ids_from_text(self, text: str) -> list[int]:
        """The token ids of a rendered chat template: BOS added unless the text starts with it."""
        bos = self.tokens[self.bos_id] if self.bos_id is not None and 0 <= self.bos_id < self.n_vocab else None
        add_special = not (bos and text.startswith(bos))
        return self.encode(text, add_special=add_special, parse_special=True)


TEMPLATE_NAMES = ("messages", "add_generation_prompt", "bos_token", "eos_token", "tools")   # what the engine passes


@dataclass
class TemplateLimits:
    """How long a chat template may render and how many characters it may write."""
    seconds: float = 2.0
    max_chars: int = 4 << 20


class TemplateLimitError(Exception):
    pass


class _BoundedRange:
    """range() for templates: at most jinja's MAX_RANGE items, and iteration checks the render's clock."""

    def __init__(self, env: "_BoundedSandbox", *args):
        self.env, self.r = env, safe_range(*args)

    def __len__(self):
        return len(self.r)

    def __getitem__(self, i):
        return self.r[i]

    def __contains__(self, x):
        return x in self.r

    def __iter__(self):
        for i, x in enumerate(self.r):
            if i % 256 == 0:
                self.env.check()
            yield x


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """The templates' `tojson`: json.dumps as the models' tooling renders it (jinja2's own sorts keys and escapes
    HTML characters, which changes a tool's description from what the model was trained on)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationBlocks(Extension):
    """`{% generation %}...{% endgeneration %}` (marks an assistant's text for training masks): renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox with a deadline, checked on every attribute access, call, range step and
    output piece, and a cap on the strings and lists that `*` and `**` can make."""
    intercepted_binops = frozenset(["*", "**"])

    def __init__(self, limits: TemplateLimits):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _GenerationBlocks])
        self.limits = limits
        self.deadline = time.monotonic() + limits.seconds

        def raise_exception(message):
            raise TemplateError(message)
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = raise_exception
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.globals["range"] = lambda *a: _BoundedRange(self, *a)

    def check(self, size: int = 0) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"it ran past its budget of {self.limits.seconds:g} s")
        if size > self.limits.max_chars:
            raise TemplateLimitError(f"its output passed {self.limits.max_chars:,} characters")

    def is_safe_attribute(self, obj, attr, value):
        self.check()
        return super().is_safe_attribute(obj, attr, value)

    def call(self, context, obj, *args, **kwargs):
        self.check()
        return super().call(context, obj, *args, **kwargs)

    def call_binop(self, context, operator, left, right):
        self.check()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and \
                        len(seq) * max(n, 0) > self.limits.max_chars:
                    raise TemplateLimitError(f"a repetition would pass {self.limits.max_chars:,} items")
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
            raise TemplateLimitError("an exponent above 1024")
        return super().call_binop(context, operator, left, right)


class StreamDecoder:
    """Incremental detokenizer: never emits half a UTF-8 character, never loses one."""

    def __init__(self, tok: Tokenizer, special: bool = False):
        self.tok, self.special = tok, special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, tid: int) -> str:
        return self._dec.decode(self.tok.token_bytes(tid, self.special))

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{% if role == 'system' %}{% set role = 'user' %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _fallback_template(architecture: str) -> str:
    """A file without tokenizer.chat_template gets its family's format (llama.cpp falls back to ChatML)."""
    return _GEMMA_TEMPLATE if architecture.startswith("gemma") else _CHATML_TEMPLATE
