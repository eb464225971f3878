"""Tool calling's pieces without a server: validation, the prompt for templates without tools, parsing replies."""
import json

import pytest

from engine.grammar import compile_grammar
from server.tools import (CALL_CLOSE, CALL_OPEN, ToolError, call_grammar, parse_calls, prompt_messages,
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
