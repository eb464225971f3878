"""The Python API (engine/llm.py) on SmolLM2 on the CPU: batched prompts, chat, streaming, stop strings."""
import json

import pytest

from engine import LLM, SamplingParams
from engine.runtime import Runtime

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Water boils at"]


@pytest.fixture(scope="module")
def llm(model_path):
    return LLM(model_path("smol"), device="cpu", n_ctx=128, n_parallel=2)


def test_generate_batches_and_equals_single_runs(llm, model_path):
    """Three prompts through two slots (one waits): each completion is the greedy run of that prompt alone."""
    greedy = SamplingParams(temperature=0)
    outs = llm.generate(PROMPTS, greedy, max_tokens=8)
    rt = Runtime.load(model_path("smol"), device="cpu", n_ctx=128)
    for prompt, out in zip(PROMPTS, outs):
        ids = rt.tokenizer.encode(prompt)
        ref = list(rt.generate(ids, greedy, 8))
        assert out.tokens == ref and out.text == rt.tokenizer.decode(ref)
        assert out.prompt_tokens == len(ids) and out.finish_reason in ("length", "stop")
    assert outs[0].text.startswith(" Paris")


def test_stream_pieces_make_the_text(llm):
    greedy = SamplingParams(temperature=0)
    pieces = list(llm.stream(PROMPTS[0], greedy, max_tokens=8))
    assert len(pieces) > 1 and "".join(pieces) == llm.generate(PROMPTS[0], greedy, max_tokens=8)[0].text


def test_stop_strings_and_chat(llm):
    out = llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0), max_tokens=30, stop=["7"])[0]
    assert out.finish_reason == "stop" and "7" not in out.text and out.text.strip().startswith("5")
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                     SamplingParams(temperature=0), max_tokens=24)
    assert "Paris" in reply.text and reply.prompt_tokens > 10


def test_abandoned_stream_frees_its_slot(llm):
    it = llm.stream("Once upon a time", SamplingParams(temperature=0), max_tokens=64)
    next(it)
    it.close()
    assert not llm.scheduler.has_work and len(llm.scheduler.free_slots) == 2


def test_structured_output(llm):
    import jsonschema
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                               "count": {"type": "integer", "minimum": 1, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}
    out = llm.chat([{"role": "user", "content": "Pick a colour and a count."}], json_schema=schema, max_tokens=40)
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)
    out = llm.generate("The capital of France is", max_tokens=8, grammar='root ::= " Paris" | " Rome"')[0]
    assert out.text in (" Paris", " Rome") and out.finish_reason == "stop"


def test_kv_memory_and_type(model_path):
    """LLM takes the KV cache's size and type: 8 prompts in flight in the memory of one q8_0 context of 128."""
    probe = Runtime.load(model_path("smol"), device="cpu", n_ctx=128)
    small = LLM(model_path("smol"), device="cpu", n_ctx=128, n_parallel=8, kv_type="q8_0",
                kv_memory=128 * probe.model.kv_bytes_per_token("q8_0"))
    assert small.rt.n_blocks * small.rt.block_size == 128 and type(small.rt.cache).__name__ == "Q8KVCache"
    outs = small.generate([f"Story {i}:" for i in range(8)], SamplingParams(temperature=0), max_tokens=8)
    assert all(o.finish_reason in ("length", "stop") and o.error is None for o in outs)
