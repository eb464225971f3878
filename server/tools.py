"""Tool calling for /v1/chat/completions: OpenAI's `tools` and `tool_choice`, the calls parsed from the reply.

A chat template that knows tools (it mentions `tools`) renders them itself; for one that does not, the tools are
described in the system message and the model is asked to answer a call as <tool_call>{"name": ..., "arguments":
{...}}</tool_call> (the Hermes / Qwen format), and earlier calls and tool results in the conversation are written
the same way. tool_choice "required" or a named function constrains the reply to exactly such a call, valid for the
function's parameters (a grammar, engine/grammar.py); "auto" lets the model choose and parses whatever calls it
wrote; "none" leaves the tools out.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from engine.grammar import JSON_STYLE

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
_CALL_RE = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)
# the start of a call as call_grammar writes it, up to its arguments' first character
_CALL_HEAD_RE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class ToolError(ValueError):
    """A malformed tools / tool_choice field: (param, message)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolSpec:
    functions: list[dict]          # [{"name", "description", "parameters"}] of the request's tools
    mode: str                      # "auto" | "required" | "named"
    forced: str | None = None      # the named function

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}


def tool_spec(tools, tool_choice) -> ToolSpec | None:
    """The request's tools and choice, validated; None when there are none or tool_choice is "none"."""
    if tools in (None, []):
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "tool_choice needs tools")
        return None
    if not isinstance(tools, list):
        raise ToolError("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}}")
    functions = []
    for t in tools:
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise ToolError("tools", "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise ToolError("tools", f"the parameters of '{f['name'][:40]}' must be a JSON schema object")
        functions.append({"name": f["name"], "description": str(f.get("description", "")), "parameters": params})
    if len({f["name"] for f in functions}) != len(functions):
        raise ToolError("tools", "two tools have the same name")
    if tool_choice in (None, "auto"):
        return ToolSpec(functions, "auto")
    if tool_choice == "none":
        return None
    if tool_choice == "required":
        return ToolSpec(functions, "required")
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(name, str) or name not in {f["name"] for f in functions}:
        raise ToolError("tool_choice", "tool_choice must be none, auto, required or "
                                       "{\"type\": \"function\", \"function\": {\"name\": <one of the tools>}}")
    return ToolSpec(functions, "named", name)


def template_knows_tools(source: str) -> bool:
    return "tools" in source


def prompt_messages(messages: list[dict], spec: ToolSpec | None, native: bool) -> list[dict]:
    """The messages to render: with a template that knows tools, as given (tool calls and results included);
    otherwise the tools described in the system message, earlier calls and results written as text."""
    if native:
        return messages
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"{RESULT_OPEN}{m['content']}{RESULT_CLOSE}"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "".join(f"{CALL_OPEN}{json.dumps(_call_body(c))}{CALL_CLOSE}" for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (m["content"] or "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if spec is None:
        return out
    text = ("You can call these functions. To call one, answer with " + CALL_OPEN + '{"name": <function name>, '
            '"arguments": <its arguments as a JSON object>}' + CALL_CLOSE + " and nothing else.\nFunctions:\n" +
            "\n".join(json.dumps(f) for f in spec.functions))
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + text}
    else:
        out.insert(0, {"role": "system", "content": text})
    return out


def _call_body(call) -> dict:
    f = call.get("function", {}) if isinstance(call, dict) else {}
    args = f.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        pass
    return {"name": f.get("name", ""), "arguments": args}


def call_grammar(spec: ToolSpec) -> str:
    """A Lark grammar (for engine.grammar.compile_grammar) of exactly one call, valid for the function's
    parameters: tool_choice required (any of the tools) or named."""
    options = [f for f in spec.functions if spec.mode != "named" or f["name"] == spec.forced]
    schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": f["parameters"]},
                         "required": ["name", "arguments"], "additionalProperties": False} for f in options],
              "x-guidance": JSON_STYLE}
    return f"start: {json.dumps(CALL_OPEN)} call {json.dumps(CALL_CLOSE)}\ncall: %json {json.dumps(schema)}"


def parse_calls(text: str, spec: ToolSpec) -> tuple[str | None, list[dict]]:
    """(the reply's text outside calls or None, [OpenAI tool_call]) from a reply: <tool_call> blocks, or a reply
    that is one JSON object {"name", "arguments" | "parameters"}; only calls of the request's tools count."""
    calls, rest = [], text
    for m in _CALL_RE.finditer(text):
        call = _as_call(m.group(1), spec)
        if call is not None:
            calls.append(call)
            rest = rest.replace(m.group(0), "", 1)
    if not calls:
        call = _as_call(text.strip(), spec)
        if call is not None:
            calls, rest = [call], ""
    return (rest.strip() or None) if calls else text, calls


def _as_call(raw: str, spec: ToolSpec) -> dict | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in spec.names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}


class CallStream:
    """A streamed reply split as it comes into content pieces and calls: feed(text) and finish() return
    [("content", str) | ("call", OpenAI tool_call) | ("call_head", tool_call with empty arguments) | ("call_args",
    str)]. A reply that starts with "{" may be one bare JSON call: it is held to the end. A block that is not a call of
    the request's tools stays content; whitespace around calls is dropped, as parse_calls drops it.

    With tool_choice "auto" each call goes out whole when its </tool_call> arrives (until then it may yet turn out not
    to be a call). With "required" or a named function the grammar (call_grammar) makes every block a valid call, so
    it streams as OpenAI's do: a "call_head" (id, name) as soon as the name is written, then "call_args" fragments of
    the arguments' JSON as it comes, whose concatenation is that JSON."""

    def __init__(self, spec: ToolSpec):
        self.spec, self.buf, self.mode, self.ws, self.calls = spec, "", "start", "", 0
        self.incremental = spec.mode in ("required", "named")
        self.args_at = 0                 # mode "args": where in buf the arguments' unsent text starts

    def _content(self, text: str) -> list:
        """Content out, its trailing whitespace held until text follows (dropped before and after a call)."""
        text = self.ws + text
        body = text.rstrip()
        self.ws = text[len(body):]
        if self.calls:
            body = body.lstrip()
        return [("content", body)] if body else []

    def feed(self, text: str) -> list:
        self.buf += text
        out = []
        while True:
            if self.mode == "start":
                head = self.buf.lstrip()
                if not head:
                    return out
                self.mode = "json" if head.startswith("{") else "text"
            if self.mode == "json":
                return out
            if self.mode == "text":
                i = self.buf.find(CALL_OPEN)
                if i < 0:                        # hold back what may be the start of CALL_OPEN
                    keep = next((n for n in range(min(len(CALL_OPEN) - 1, len(self.buf)), 0, -1)
                                 if CALL_OPEN.startswith(self.buf[-n:])), 0)
                    out += self._content(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                out += self._content(self.buf[:i])
                self.buf, self.mode = self.buf[i:], "call"
            if self.mode == "call" and self.incremental:
                m = _CALL_HEAD_RE.match(self.buf, len(CALL_OPEN))
                if m and m.end() < len(self.buf):              # the name is complete (the arguments have begun)
                    name = json.loads(f'"{m.group(1)}"')
                    if name in self.spec.names:
                        self.ws = ""
                        out.append(("call_head", {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                                                  "function": {"name": name, "arguments": ""}}))
                        self.mode, self.args_at = "args", m.end()
            j = self.buf.find(CALL_CLOSE)
            if self.mode == "args":
                if j < 0:                         # hold back what may be the call's closing "}" and CALL_CLOSE
                    b = self.buf
                    k = next((n for n in range(min(len(CALL_CLOSE) - 1, len(b)), 0, -1)
                              if CALL_CLOSE.startswith(b[-n:])), 0)
                    b = b[:len(b) - k].rstrip()
                    end = len(b[:-1].rstrip() if b.endswith("}") else b)
                    if end > self.args_at:
                        out.append(("call_args", self.buf[self.args_at:end]))
                        self.args_at = end
                    return out
                body = self.buf[:j].rstrip()
                body = body[:-1].rstrip() if body.endswith("}") else body     # the call object's closing brace
                if len(body) > self.args_at:
                    out.append(("call_args", body[self.args_at:]))
                self.buf, self.mode = self.buf[j + len(CALL_CLOSE):], "text"
                self.calls += 1
                continue
            if j < 0:
                return out
            block, self.buf = self.buf[:j + len(CALL_CLOSE)], self.buf[j + len(CALL_CLOSE):]
            call = _as_call(block[len(CALL_OPEN):-len(CALL_CLOSE)].strip(), self.spec)
            if call is None:
                out += self._content(block)
            else:
                self.ws = ""
                self.calls += 1
                out.append(("call", call))
            self.mode = "text"

    def finish(self) -> list:
        rest, self.buf = self.buf, ""
        if self.mode == "args":                   # cut off inside a call (max_tokens): what came of its arguments
            self.mode = "text"
            self.calls += 1
            tail = rest[self.args_at:]
            return [("call_args", tail)] if tail else []
        if self.mode == "json":
            call = _as_call(rest.strip(), self.spec)
            if call is not None:
                self.calls += 1
                return [("call", call)]
        out = self._content(rest)
        if not self.calls and self.ws:           # no call: the reply as it was, its trailing whitespace too
            out.append(("content", self.ws))
        self.ws = ""
        return out
