"""Tool calling's pieces without a server: validation, the prompt for templates without tools, parsing replies."""
import json

import pytest

from engine.grammar import compile_grammar
from server.tools import (CALL_CLOSE, CALL_OPEN, CallStream, ToolError, call_grammar, parse_calls, prompt_messages,
                          template_knows_tools, tool_spec)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_tool_spec_validation():
    assert tool_spec(None, None) is None and tool_spec([WEATHER], "none") is None
    assert tool_spec([WEATHER, TIME], None).mode == "auto"
    spec = tool_spec([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert spec.mode == "named" and spec.forced == "get_time" and spec.names == {"get_weather", "get_time"}
    for tools, choice, param in [("x", None, "tools"), ([{"type": "function"}], None, "tools"),
                                 ([WEATHER, WEATHER], None, "tools"), (None, "required", "tool_choice"),
                                 ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
                                 ([WEATHER], "sometimes", "tool_choice")]:
        with pytest.raises(ToolError) as err:
            tool_spec(tools, choice)
        assert err.value.param == param


def test_parse_calls():
    spec = tool_spec([WEATHER, TIME], None)
    content, calls = parse_calls(f'Let me look. {CALL_OPEN}{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}'
                                 f'{CALL_CLOSE}{CALL_OPEN}{{"name": "get_time", "arguments": {{}}}}{CALL_CLOSE}', spec)
    assert content == "Let me look." and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"} and calls[0]["id"].startswith("call_")
    assert parse_calls('{"name": "get_time", "parameters": {}}', spec)[1][0]["function"]["name"] == "get_time"
    for text in ("The weather is fine.", f'{CALL_OPEN}{{"name": "unknown", "arguments": {{}}}}{CALL_CLOSE}',
                 f"{CALL_OPEN}not json{CALL_CLOSE}", '{"name": "get_time", "arguments": 5}'):
        assert parse_calls(text, spec) == (text, [])


def test_prompt_without_native_tools():
    spec = tool_spec([WEATHER], "auto")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    out = prompt_messages(msgs, spec, native=False)
    assert out[0]["role"] == "system" and "get_weather" in out[0]["content"] and "Be brief." in out[0]["content"]
    assert out[2]["content"] == f'{CALL_OPEN}{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}{CALL_CLOSE}'
    assert out[3] == {"role": "user", "content": "<tool_response>12 C</tool_response>"}
    assert prompt_messages(msgs, spec, native=True) is msgs
    assert template_knows_tools("{% if tools %}...{% endif %}") and not template_knows_tools("{{ messages }}")


def test_call_grammar_compiles():
    assert compile_grammar(lark=call_grammar(tool_spec([WEATHER, TIME], "required")))
    assert '"const": "get_time"' in call_grammar(tool_spec([WEATHER, TIME], {"type": "function",
                                                                              "function": {"name": "get_time"}}))


def stream_all(text: str, step: int, spec) -> tuple[str | None, list[dict]]:
    """CallStream fed `step` characters at a time: (the content it streamed, or None; its calls)."""
    parser, items = CallStream(spec), []
    for i in range(0, len(text), step):
        items += parser.feed(text[i:i + step])
    items += parser.finish()
    content = "".join(v for k, v in items if k == "content")
    return content or None, [v for k, v in items if k == "call"]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_call_stream_matches_parse_calls(step):
    """Streamed in pieces of any size, the content and calls are parse_calls' (content before a call goes out before
    the call is written, each call as soon as it closes)."""
    spec = tool_spec([WEATHER, TIME], None)
    replies = [f'Let me look. {CALL_OPEN}{{"name": "get_weather", "arguments": {{"city": "Oslo"}}}}{CALL_CLOSE}\n'
               f'{CALL_OPEN}{{"name": "get_time", "arguments": {{}}}}{CALL_CLOSE}',
               '{"name": "get_time", "parameters": {}}', "The weather is fine.\nReally <tool fine>.",
               f'{CALL_OPEN}{{"name": "unknown", "arguments": {{}}}}{CALL_CLOSE}', f"{CALL_OPEN}not json{CALL_CLOSE}",
               '{"name": "get_time", "arguments": 5}', "  leading spaces stay", "<tool_cal", "a < b <tool_callx"]
    for text in replies:
        content, calls = stream_all(text, step, spec)
        want_content, want_calls = parse_calls(text, spec)
        assert content == want_content, (text, step)
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
            [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in want_calls], (text, step)


def test_call_stream_sends_text_and_calls_early():
    """Text before a call is out before the call arrives; the call is out when </tool_call> is."""
    spec = tool_spec([WEATHER], None)
    parser = CallStream(spec)
    assert parser.feed("Checking the ") == [("content", "Checking the")]      # trailing whitespace waits
    assert parser.feed("weather.<tool") == [("content", " weather.")]
    assert parser.feed('_call>{"name": "get_weather", "arguments": {"city": "Rome"}}') == []
    out = parser.feed(CALL_CLOSE)
    assert len(out) == 1 and out[0][0] == "call" and json.loads(out[0][1]["function"]["arguments"]) == {"city": "Rome"}
    assert parser.finish() == []


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_constrained_calls_stream_their_arguments(step):
    """tool_choice required: each call's head (id, name) goes out once its name is written, then its arguments in
    fragments that concatenate to the arguments' JSON; the closing brace and </tool_call> never leak into them."""
    spec = tool_spec([WEATHER, TIME], "required")
    args = [{"city": 'Oslo, "Norway" } {'}, {}]
    text = "".join(f'{CALL_OPEN}{{"name": "{n}", "arguments": {json.dumps(a)}}}{ws}{CALL_CLOSE}'
                   for n, a, ws in zip(["get_weather", "get_time"], args, ["", " \n"]))
    parser, items = CallStream(spec), []
    for i in range(0, len(text), step):
        items += parser.feed(text[i:i + step])
    items += parser.finish()
    assert [k for k, _ in items if k != "call_args"] == ["call_head", "call_head"]
    calls, frags = [], []
    for kind, value in items:
        if kind == "call_head":
            calls.append((value["function"]["name"], []))
            assert value["id"].startswith("call_") and value["function"]["arguments"] == ""
        else:
            calls[-1][1].append(value)
            frags.append(value)
    assert [(n, json.loads("".join(f))) for n, f in calls] == [("get_weather", args[0]), ("get_time", args[1])]
    if step == 1:
        assert len(calls[0][1]) > 5                      # the arguments came as they were written
    assert parser.calls == 2


def test_constrained_call_cut_short_keeps_what_came():
    spec = tool_spec([WEATHER], "required")
    parser = CallStream(spec)
    items = parser.feed(f'{CALL_OPEN}{{"name": "get_weather", "arguments": {{"city": "Ber') + parser.finish()
    assert items[0][0] == "call_head" and "".join(v for k, v in items[1:]) == '{"city": "Ber'


def template_tokenizer(template: str):
    """A three-token SPM vocabulary whose chat template is template."""
    from types import SimpleNamespace

    import numpy as np

    from engine.tokenizer import Tokenizer
    md = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"],
          "tokenizer.ggml.token_type": np.array([2, 3, 3], np.int32), "tokenizer.ggml.bos_token_id": 1,
          "tokenizer.ggml.eos_token_id": 2, "tokenizer.chat_template": template}
    return Tokenizer(SimpleNamespace(path="a chat template", metadata=md))


def test_templates_render_tools_as_the_models_tooling_does():
    """`tojson` as Hugging Face's apply_chat_template has it (json.dumps: keys in the caller's order, no HTML escapes,
    indent as asked; jinja2's own sorts keys and writes < as \\u003c), `{% break %}` / `{% continue %}` and
    `{% generation %}` blocks, which the model makers' templates use."""
    tool = {"type": "function", "function": {"name": "get_weather", "description": "Weather <now> in a city, l'été",
                                             "parameters": WEATHER["function"]["parameters"]}}
    tok = template_tokenizer("{% for t in tools %}{{ t | tojson }}\n{% endfor %}{{ tools[0] | tojson(indent=4) }}")
    assert tok.apply_chat_template([], tools=[tool, TIME]) == (
        json.dumps(tool, ensure_ascii=False) + "\n" + json.dumps(TIME) + "\n" + json.dumps(tool, indent=4,
                                                                                           ensure_ascii=False))
    tok = template_tokenizer("{% for m in messages %}{% if m.role == 'tool' %}{% continue %}{% endif %}"
                             "{% if loop.index > 3 %}{% break %}{% endif %}{% generation %}[{{ m.content }}]"
                             "{% endgeneration %}{% endfor %}")
    messages = [{"role": r, "content": c} for r, c in [("user", "a"), ("tool", "b"), ("assistant", "c"),
                                                         ("user", "d"), ("user", "e")]]
    assert tok.apply_chat_template(messages) == "[a][c]"


def test_template_variables_reach_the_template():
    """A request's chat_template_kwargs (Qwen 3's enable_thinking) are names the template sees; the engine's own
    names cannot be replaced."""
    from engine.tokenizer import TokenizerError
    tok = template_tokenizer("{{ messages[0].content }}{% if enable_thinking is defined and not enable_thinking %}"
                             "<think></think>{% endif %}")
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages) == "hi"
    assert tok.apply_chat_template(messages, variables={"enable_thinking": False}) == "hi<think></think>"
    with pytest.raises(TokenizerError, match="cannot replace messages"):
        tok.apply_chat_template(messages, variables={"messages": []})
