"""Structured output: grammars compiled by llguidance, masks applied in the scheduler's sampling, on the CPU."""
import json

import numpy as np
import pytest

from conftest import run_requests
from engine.grammar import Constraint, GrammarError, compile_grammar, grammar_tokenizer
from engine.runtime import Runtime
from engine.sampling import SamplingParams
from engine.scheduler import FinishEvent, Request, Scheduler, TokenEvent

jsonschema = pytest.importorskip("jsonschema")   # a test dependency (the GPU machine lacks it; no gpu tests here)

# 20 schemas: nested objects, arrays, enums, bounded numbers, required and optional fields. Strings and arrays carry
# length bounds so that every output ends inside the token budget at temperature 1.0.
NAME = {"type": "string", "maxLength": 12}
SCHEMAS = [
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"],
                                                                        "maxLength": 10}},
     "required": ["ok", "note"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}}, "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "maxItems": 3}}, "required": ["tags"]},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {"type": "object", "properties": {"status": {"const": "done"}, "count": {"type": "integer", "minimum": 1,
                                                                          "maximum": 9}},
     "required": ["status", "count"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"id": {"type": "integer",
                                                                                      "minimum": 1,
                                                                                      "maximum": 9999},
                                                                               "name": NAME},
                                               "required": ["id"], "additionalProperties": False},
                                      "active": {"type": "boolean"}}, "required": ["user", "active"],
     "additionalProperties": False},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100},
                                      "currency": {"enum": ["EUR", "USD"]}}, "required": ["price", "currency"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3},
                                      "b": {"type": "integer", "minimum": 0, "maximum": 3},
                                      "c": {"type": "integer", "minimum": 0, "maximum": 3}},
     "required": ["a", "b", "c"], "additionalProperties": False},
    {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
     "required": ["email"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"sku": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"],
     "additionalProperties": False},
    {"type": "null"},
    {"type": "object", "properties": {"level": {"enum": [1, 2, 3]}, "label": NAME}, "required": ["level"],
     "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
]


def text_of(tok, events):
    return tok.decode([e.token for e in events if isinstance(e, TokenEvent)])


def test_compile_errors_name_the_problem():
    for args in ({"gbnf": "root ::= [a-"}, {"gbnf": 'root ::= "a" undefined_rule'}, {"gbnf": 'rot ::= "a"'},
                 {"lark": "start: ("},
                 {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
                 {"json_schema": []}, {}):
        with pytest.raises(GrammarError) as err:
            compile_grammar(**args)
        assert "\n" not in str(err.value) and len(str(err.value)) < 400
    assert compile_grammar(gbnf='root ::= "yes" | "no"')
    assert compile_grammar(json_object=True)


@pytest.mark.slow
def test_twenty_schemas_at_temperature_one(model_path):
    """Every output of 20 schemas, sampled at temperature 1.0 on SmolLM2, parses and validates; and ends by the
    grammar ("stop") well inside its budget."""
    rt = Runtime.load(model_path("smol"), device="cpu", n_ctx=512, n_seq=len(SCHEMAS))
    tok = rt.tokenizer
    prompt = tok.encode("Answer in JSON: ")
    reqs = [Request(prompt, SamplingParams(temperature=1.0, seed=i), 200, grammar=compile_grammar(json_schema=s))
            for i, s in enumerate(SCHEMAS)]
    for schema, events in zip(SCHEMAS, run_requests(Scheduler(rt), reqs)):
        text = text_of(tok, events)
        assert isinstance(events[-1], FinishEvent) and events[-1].reason == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.slow
def test_gbnf_greedy_and_masks(model_path):
    """A GBNF grammar's output is one of its words, greedy; every mask step allows only tokens the grammar can
    continue with (each sampled token is consumed without error) and end-of-generation only once it is complete."""
    rt = Runtime.load(model_path("smol"), device="cpu", n_ctx=256, n_seq=2)
    tok = rt.tokenizer
    grammar = compile_grammar(gbnf='root ::= ("Paris" | "London" | "Rome") "."')
    prompt = tok.encode("The capital of France is")
    events = run_requests(Scheduler(rt), [Request(prompt, SamplingParams(temperature=0), 20, grammar=grammar),
                                 Request(prompt, SamplingParams(temperature=0), 20)])
    assert text_of(tok, events[0]) in ("Paris.", "London.", "Rome.") and events[0][-1].reason == "stop"
    c = Constraint(grammar_tokenizer(tok, rt.config.n_vocab), grammar, rt.config.n_vocab)
    eog = np.array(sorted(tok.eog_ids))
    assert not c.allowed()[eog].any()
    for t in tok.encode("Rome.", add_special=False):
        assert c.allowed()[t]
        c.consume(t)
    assert c.done


@pytest.mark.slow
def test_constrained_and_free_rows_in_one_step(model_path):
    """The scheduler keeps constrained and free rows apart in one step: the free row samples as it would alone,
    the constrained one only from its grammar (the first schema)."""
    path = model_path("smol")
    rt = Runtime.load(path, device="cpu", n_ctx=256, n_seq=2)
    tok = rt.tokenizer
    prompt = tok.encode("List three colours:")
    alone = run_requests(Scheduler(Runtime.load(path, device="cpu", n_ctx=256)),
                [Request(prompt, SamplingParams(temperature=0), 12, ignore_eos=True)])[0]
    both = run_requests(Scheduler(rt), [Request(prompt, SamplingParams(temperature=0.7, seed=3), 60,
                                       grammar=compile_grammar(json_schema=SCHEMAS[0])),
                               Request(prompt, SamplingParams(temperature=0), 12, ignore_eos=True)])
    assert text_of(tok, both[1]) == text_of(tok, alone)
    assert both[0][-1].reason == "stop"
    jsonschema.validate(json.loads(text_of(tok, both[0])), SCHEMAS[0])


@pytest.mark.slow
def test_batch_masks_equal_each_constraint(model_path):
    """batch_masks (llguidance's threads, every row at once) gives each Constraint's own mask, at different states
    of different grammars."""
    from engine.grammar import batch_masks, mask_flags
    rt = Runtime.load(model_path("smol"), device="cpu", n_ctx=64)
    tok, n_vocab = rt.tokenizer, rt.config.n_vocab
    ll_tok = grammar_tokenizer(tok, n_vocab)
    cs = [Constraint(ll_tok, compile_grammar(json_schema=s), n_vocab) for s in SCHEMAS[:3]]
    cs.append(Constraint(ll_tok, compile_grammar(gbnf='root ::= ("Paris" | "London") "."'), n_vocab))
    for t in tok.encode('{"', add_special=False):
        cs[1].consume(t)
    cs[3].consume(tok.encode("London", add_special=False)[0])
    got = mask_flags(batch_masks(cs), n_vocab)
    for j, c in enumerate(cs):
        assert np.array_equal(got[j], c.allowed()), j
    assert not np.array_equal(got[0], got[1])


def test_any_allowed_reads_only_the_vocabulary():
    """any_allowed: a row allows some token among the first n_vocab (bits past it, in the last word or whole words
    beyond, do not count), as mask_flags says."""
    from engine.grammar import any_allowed, mask_flags
    rng = np.random.default_rng()
    n_vocab = 100                                   # 3 full words and 4 bits of the fourth; 5 words in the masks
    masks = np.zeros((6, 5), np.int32)
    masks[1, 0] = 1 << 5
    masks[2, 3] = 1 << 3                            # token 99: the last one
    masks[3, 3] = 1 << 4                            # token 100: past the vocabulary
    masks[4, 4] = -1
    masks[5] = rng.integers(-2 ** 31, 2 ** 31, 5, dtype=np.int64).astype(np.int32)
    masks[5, 0] |= 1
    assert any_allowed(masks, n_vocab).tolist() == [False, True, True, False, False, True]
    assert np.array_equal(any_allowed(masks, n_vocab), mask_flags(masks, n_vocab).any(axis=1))


@pytest.mark.slow
def test_logit_bias_and_grammar_in_one_row(model_path):
    """A row with both a grammar and a logit bias: the bias is added, then the mask applies, so a bias of -100 on the
    grammar's greedy first token makes it take another that the grammar allows (the output stays one of its words);
    a grammar no matcher can be made of ends its request alone with an error while the others finish."""
    rt = Runtime.load(model_path("smol"), device="cpu", n_ctx=256, n_seq=3)
    tok = rt.tokenizer
    grammar = compile_grammar(gbnf='root ::= (" Paris" | " Rome") "."')
    prompt = tok.encode("The capital of France is")
    plain = run_requests(Scheduler(rt), [Request(prompt, SamplingParams(temperature=0), 10, grammar=grammar)])[0]
    assert text_of(tok, plain) == " Paris."
    first = next(e.token for e in plain if isinstance(e, TokenEvent))
    events = run_requests(Scheduler(rt), [Request(prompt, SamplingParams(temperature=0), 10, grammar=grammar,
                                         logit_bias={first: -100.0}),
                                 Request(prompt, SamplingParams(temperature=0), 10, grammar="%% not a grammar"),
                                 Request(prompt, SamplingParams(temperature=0), 3, ignore_eos=True)])
    tokens = [e.token for e in events[0] if isinstance(e, TokenEvent)]
    assert tokens[0] != first and text_of(tok, events[0]) in (" Paris.", " Rome.") and events[0][-1].reason == "stop"
    assert events[1][-1].reason == "error" and not any(isinstance(e, TokenEvent) for e in events[1])
    assert events[2][-1].reason == "length"


@pytest.mark.slow
def test_constraints_of_one_grammar_are_independent_copies(model_path):
    """Constraints of one grammar start from a kept matcher's copy: each starts where a new matcher starts (the same
    mask), and consuming in one leaves the others (and later ones) at the start."""
    import engine.grammar as G
    rt = Runtime.load(model_path("smol"), device="cpu", n_ctx=64)
    tok, n_vocab = rt.tokenizer, rt.config.n_vocab
    ll_tok = grammar_tokenizer(tok, n_vocab)
    grammar = compile_grammar(json_schema=SCHEMAS[0])
    fresh = G._llguidance().LLMatcher(ll_tok, grammar, log_level=0)
    bits = np.empty((ll_tok.vocab_size + 31) // 32, np.int32)
    fresh.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
    start = G.mask_flags(bits[None], n_vocab)[0]
    a, b = (Constraint(ll_tok, grammar, n_vocab) for _ in range(2))
    assert np.array_equal(a.allowed(), start) and np.array_equal(b.allowed(), start)
    for t in tok.encode('{"', add_special=False):
        a.consume(t)
    assert not np.array_equal(a.allowed(), start)
    assert np.array_equal(b.allowed(), start) and np.array_equal(Constraint(ll_tok, grammar, n_vocab).allowed(), start)
    assert G._templates[(id(ll_tok), grammar)][0] is ll_tok                  # kept once for this vocabulary
