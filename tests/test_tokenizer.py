"""Tokenizers against llama.cpp's tokenizations, round trips, streaming, chat templates, speed."""
import random
import time

import pytest
import regex
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from conftest import GOLDEN, read_golden, read_prompts
from engine import hub
from engine.gguf import GGUFFile
from engine.tokenizer import PRE_TOKENIZERS, Tokenizer, TokenizerError, _regex_split, _splitter

pytestmark = pytest.mark.slow
KEYS = ["smol", "gemma"]
_cache = {}


def representable(tok: Tokenizer, text: str) -> bool:
    """Whether every byte of the text has a token (SmolLM2's BPE vocabulary lacks a few byte tokens, e.g. 0xF1), and
    (SPM) the text has no U+2581, the symbol SPM writes spaces as: it decodes to a space, in llama.cpp too."""
    if tok.model != "gpt2":
        return "\u2581" not in text
    return all(tok._b2u[b] in tok.token_to_id for b in text.encode("utf-8"))


def tokenizer(model_path, key) -> Tokenizer:
    if key not in _cache:
        _cache[key] = Tokenizer(GGUFFile(model_path(key)))
    return _cache[key]


@pytest.mark.parametrize("key", KEYS)
def test_golden_prompts(model_path, key):
    tok = tokenizer(model_path, key)
    for prompt, rec in zip(read_prompts(key), read_golden(key, "cpu")):
        assert tok.encode(prompt) == rec["prompt_tokens"], prompt[:40]


@pytest.mark.parametrize("key", KEYS)
def test_apache_text(model_path, key):
    tok = tokenizer(model_path, key)
    text = (GOLDEN / "apache.txt").read_text(encoding="utf-8")
    ref = [int(x) for x in (GOLDEN / f"apache.{key}.tokens").read_text().split()]
    assert tok.encode(text) == ref
    assert tok.decode(ref) == text


@pytest.mark.parametrize("key", KEYS)
def test_texts_sharing_a_prefix_tokenize_as_alone(model_path, key):
    """The Apache text, then texts cut from it at random with another ending (a resent conversation, a shared system
    prompt): the tokenizer that kept the earlier texts' pieces (engine/piece_cache.py) gives the ids of splitting them whole, and
    the reference ids for the whole text again."""
    rng = random.Random()
    text = (GOLDEN / "apache.txt").read_text(encoding="utf-8")
    ref = [int(x) for x in (GOLDEN / f"apache.{key}.tokens").read_text().split()]
    warm = Tokenizer(GGUFFile(model_path(key)))
    assert warm.encode(text) == ref
    endings = ["", " ", "\n", "\n\n", "  and", " questions?", "\nUser: what is a License?\n", "1234", " \u4e2d\u6587!"]
    whole = Tokenizer(GGUFFile(model_path(key)))                 # splits every text whole, keeps none
    whole._pieces.tokenize = lambda t, split, piece_ids: [i for p in split(t) for i in piece_ids(p)]
    for _ in range(30):
        cut = rng.randint(len(text) // 2, len(text))
        variant = text[:cut] + rng.choice(endings) + rng.choice(endings)
        assert warm.encode(variant) == whole.encode(variant), (cut, variant[-40:])
    assert warm.encode(text) == ref


@pytest.mark.parametrize("key", KEYS)
def test_apache_speed(model_path, key):
    tok = tokenizer(model_path, key)
    text = (GOLDEN / "apache.txt").read_text(encoding="utf-8")
    if hasattr(tok, "_word_cache"):
        tok._word_cache.clear()
    t0 = time.perf_counter()
    tok.encode(text)
    elapsed = time.perf_counter() - t0
    print(f"{key}: apache.txt ({len(text)} chars) tokenized in {elapsed * 1000:.1f} ms")
    assert elapsed < 0.100


@pytest.mark.parametrize("key", KEYS)
def test_golden_round_trip(model_path, key):
    tok = tokenizer(model_path, key)
    for prompt in read_prompts(key):
        assert tok.decode(tok.encode(prompt, add_special=False), special=True) == prompt


text_strategy = st.lists(st.one_of(
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
    st.sampled_from([" ", "  ", "\t", "\n", "\n\n", "\r\n", "\u00a0", "0", "123", "4567", "中文", "日本語", "😀",
                     "👩\u200d👩\u200d👧", "\u0301", "\u0308", "ﬁ", "'s", "<|im_start|>", "<start_of_turn>"])),
    max_size=40).map("".join)


@pytest.mark.parametrize("key", KEYS)
@settings(max_examples=150, deadline=None)
@given(text=text_strategy)
def test_round_trip_property(model_path, key, text):
    tok = tokenizer(model_path, key)
    assume(representable(tok, text))
    ids = tok.encode(text, add_special=False, parse_special=False)
    assert tok.decode(ids) == text


@pytest.mark.parametrize("key", KEYS)
@settings(max_examples=100, deadline=None)
@given(text=text_strategy)
def test_stream_decoder_never_splits_characters(model_path, key, text):
    tok = tokenizer(model_path, key)
    assume(representable(tok, text))
    dec = tok.stream_decoder()
    pieces = [dec.add(t) for t in tok.encode(text, add_special=False, parse_special=False)] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_special_tokens(model_path):
    smol = tokenizer(model_path, "smol")
    assert smol.encode("<|im_start|>user") [0] == 1
    plain = smol.encode("<|im_start|>user", parse_special=False)
    assert 1 not in plain and smol.decode(plain) == "<|im_start|>user"
    gemma = tokenizer(model_path, "gemma")
    ids = gemma.encode("<start_of_turn>user")
    assert ids[0] == gemma.bos_id and ids[1] == gemma.token_to_id["<start_of_turn>"]


def test_chat_templates(model_path):
    msgs = [{"role": "user", "content": "Hi"}]
    smol = tokenizer(model_path, "smol").apply_chat_template(msgs)
    assert smol.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    gemma = tokenizer(model_path, "gemma")
    text = gemma.apply_chat_template(msgs)
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma.chat_prompt_ids(msgs)
    assert ids.count(gemma.bos_id) == 1


def test_broken_template_is_a_clear_error(model_path):
    tok = tokenizer(model_path, "smol")
    saved = tok.chat_template
    try:
        tok.chat_template = "{{ raise_exception('no system role') }}"
        with pytest.raises(TokenizerError, match="no system role"):
            tok.apply_chat_template([{"role": "user", "content": "x"}])
        tok.chat_template = "{% for m in messages %}{{ m.content.nope() }}{% endfor %}"
        with pytest.raises(TokenizerError, match="chat template failed"):
            tok.apply_chat_template([{"role": "user", "content": "x"}])
    finally:
        tok.chat_template = saved


@pytest.mark.parametrize("template,words", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "budget"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "stopped"),
    ("{{ 'x' * 10**8 }}", "repetition"),
    ("{% set e = 10**9 %}{{ 7 ** e }}", "exponent"),
])
def test_hostile_chat_templates_stop_with_an_error(template, words):
    """A GGUF's chat template runs in a sandbox with a time budget and an output cap: a clear error in seconds."""
    import threading
    from engine.tokenizer import TemplateLimits
    tok = Tokenizer(GGUFFile(hub.fetch("smollm2-135m")))
    tok.chat_template = template
    outcome = []

    def render():
        try:
            tok.apply_chat_template([{"role": "user", "content": "hi"}], limits=TemplateLimits(seconds=1.0))
            outcome.append("rendered")
        except TokenizerError as e:
            outcome.append(str(e))
    th = threading.Thread(target=render, daemon=True)
    th.start()
    th.join(timeout=10)
    assert outcome and words in outcome[0], outcome


def _bpe_word_reference(tok, word: str) -> list[int]:
    """The textbook loop (merge every occurrence of the best-ranked pair, left to right, until none is ranked):
    quadratic in the word's length, the reference for the heap-based _bpe_word."""
    parts = list(word)
    while len(parts) > 1:
        ranked = [(tok._ranks[(a, b)], i) for i, (a, b) in enumerate(zip(parts, parts[1:])) if (a, b) in tok._ranks]
        if not ranked:
            break
        a, b = parts[min(ranked)[1]], parts[min(ranked)[1] + 1]
        merged, i = [], 0
        while i < len(parts):
            if i < len(parts) - 1 and parts[i] == a and parts[i + 1] == b:
                merged.append(a + b)
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return [tok.token_to_id[p] if p in tok.token_to_id else -1 for p in parts]


def test_bpe_heap_merge_equals_the_reference_loop():
    import random
    tok = Tokenizer(GGUFFile(hub.fetch("smollm2-135m")))
    rng = random.Random()
    alphabets = ["ab", "abc ", "thequickbrownfox", "aeiou", "0123456789"]
    for _ in range(300):
        letters = rng.choice(alphabets)
        word = "".join(rng.choice(letters) for _ in range(rng.randint(1, 60)))
        word = "".join(tok._b2u[b] for b in word.encode())
        ref = _bpe_word_reference(tok, word)
        if -1 not in ref:
            assert tok._bpe_word(word) == ref, word


def test_long_unbroken_word_tokenizes_in_linear_time():
    """64 KB of random letters is one pre-tokenizer word: 21.5 s with the quadratic loop, well under a second now."""
    import random
    import string
    tok = Tokenizer(GGUFFile(hub.fetch("smollm2-135m")))
    text = "".join(random.choice(string.ascii_letters) for _ in range(64 * 1024))
    t0 = time.perf_counter()
    ids = tok.encode(text)
    assert time.perf_counter() - t0 < 3.0 and len(ids) > 10_000


def test_special_tokens_split_as_the_definition_does():
    """Gemma 3 has 6,414 special tokens, overlapping whitespace runs among them: texts built of their pieces split
    exactly as the longest-first loop over all of them (the definition) splits them, though only those the text holds
    are tried."""
    import random
    tok = Tokenizer(GGUFFile(hub.fetch("gemma3-270m")))
    rng = random.Random()
    pieces = [tok.tokens[t] for t in rng.sample(tok._specials, 40)] + \
        ["\n", "\n\n", "\t", "  ", " ", "<", "start", "_of", "x", "é", "<start_of_turn>"]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 30)))
        for parse_special in (True, False):
            assert tok._partition(text, parse_special) == tok._split_out(text, tok._specials, parse_special), text


def test_spm_word_by_word_equals_merging_the_whole_text():
    """SPM merges word by word (split before each "▁" that follows another character, each word's ids kept) give
    the ids of merging the whole text at once, with Gemma 3's one token that spans such a "▁" ('>▁</') among the
    pieces: a text holding it is merged whole."""
    import random
    tok = Tokenizer(GGUFFile(hub.fetch("gemma3-270m")))
    assert tok._spm_bridges == [">\u2581</"]
    rng = random.Random()
    pieces = ["the", " the", " quick", "  ", "   ", "\n", "\t", ">", "</", " </", "> </", "div>", "é", "中文", "🙂", "x",
              "ab", "1234", " (", ")", ".", "\u2581", "\u2581\u2581y"]
    for _ in range(400):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))).replace(" ", "\u2581")
        assert tok._spm_words(text) == tok._spm(text), text
        assert tok._spm_words(text) == tok._spm(text), text           # the second time from the kept words


def test_many_user_defined_tokens_do_not_slow_encoding(tmp_path):
    """A vocabulary padded with 79k user-defined tokens (the synthetic 8B's): 14 ms per short prompt when every
    special token was searched for, under 1 ms now; the tokens still split out."""
    import gguf
    src = gguf.GGUFReader(hub.fetch("smollm2-135m"))
    field = lambda k: src.fields[k].contents()  # noqa: E731
    toks, types = list(field("tokenizer.ggml.tokens")), list(field("tokenizer.ggml.token_type"))
    n0 = len(toks)
    toks += [f"<|pad_{i}|>" for i in range(128_256 - n0)]
    types += [4] * (128_256 - n0)
    w = gguf.GGUFWriter(str(tmp_path / "padded.gguf"), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(toks)
    w.add_token_types(types)
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    tok = Tokenizer(GGUFFile(str(tmp_path / "padded.gguf")))
    plain = Tokenizer(GGUFFile(hub.fetch("smollm2-135m")))
    prompts = [f"Client {i} request {i * 7}: write a story about" for i in range(100)]
    t0 = time.perf_counter()
    ids = [tok.encode(p, add_special=False) for p in prompts]
    assert (time.perf_counter() - t0) / len(prompts) < 1e-3
    assert ids == [plain.encode(p, add_special=False) for p in prompts]
    assert tok.encode("a<|pad_77|>b", add_special=False) == \
        plain.encode("a", add_special=False) + [n0 + 77] + plain.encode("b", add_special=False)


def finditer_split(text: str, patterns: list[str]) -> list[str]:
    """The pre-tokenizer split spelled out: each pattern's matches, and the text between them, as pieces."""
    pieces = [text]
    for pattern in patterns:
        out = []
        for piece in pieces:
            start = 0
            for m in regex.finditer(pattern, piece):
                out += [piece[start:m.start()]] * (m.start() > start) + [m.group()]
                start = m.end()
            out += [piece[start:]] * (start < len(piece))
        pieces = out
    return pieces


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_regex_split_equals_finditer(pre):
    rng = random.Random()
    alphabet = list("abcXYZ  \n\t\r'0123456789.,!?$+<=>^~|_-\u00e9\u00df\u4e2d\u6587\U0001f642") + ["'s", "'LL", "\r\n"]
    splitters = [_splitter(p) for p in PRE_TOKENIZERS[pre]]
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        assert _regex_split(text, splitters) == finditer_split(text, PRE_TOKENIZERS[pre]), repr(text)


def test_splitter_refuses_a_capturing_group():
    with pytest.raises(ValueError, match="capturing group"):
        _splitter(r"(a)|b")
