"""OpenAI request bodies (pydantic) and the error format."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


MAX_INT = 2 ** 31 - 1          # integer fields above this are refused (they also cross the IPC as 64-bit ints)


def check_utf8(text: str) -> str:
    """Text that can be encoded as UTF-8 (JSON lets a lone surrogate such as \\ud800 through)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text is not valid UTF-8 (a lone surrogate)") from None
    return text


def check_prompt(prompt):
    """A prompt (text, token ids, or a list of texts or of token lists) whose texts are valid UTF-8."""
    for s in [prompt] if isinstance(prompt, str) else prompt:
        if isinstance(s, str):
            check_utf8(s)
    return prompt


def _refused(name: str, value) -> str | None:
    """Why a request field that would change the output cannot be honoured (None: absent, empty or harmless)."""
    if value is None or value == [] or value == {} or value == "":
        return None
    if name in NEUTRAL and value == NEUTRAL[name]:
        return None
    if name == "top_n_sigma" and isinstance(value, (int, float)) and value <= 0:      # llama.cpp: <= 0 is off
        return None
    return REFUSED_FIELDS[name]


# Fields of the OpenAI and llama-server APIs this server cannot honour yet: a request that sets one gets a 400 naming
# it rather than an answer that silently ignores it.
REFUSED_FIELDS = {
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "n_probs": "n_probs is llama-server's /completion field; use logprobs here",
    "best_of": "best_of is not supported (only 1)",
    "suffix": "suffix (infilling) is not supported",
    "prediction": "predicted outputs are not supported",
    "audio": "audio output is not supported",
    "modalities": "only the 'text' modality is supported",
    "typical_p": "typical sampling is not supported",
    "mirostat": "mirostat sampling is not supported",
    "dry_multiplier": "DRY sampling is not supported",
    "xtc_probability": "XTC sampling is not supported",
    "dynatemp_range": "dynamic temperature is not supported",
    "top_n_sigma": "top-n-sigma sampling is not supported",
    "min_tokens": "min_tokens is not supported",
    "stop_token_ids": "stop_token_ids is not supported (stop strings are)",
    "include_stop_str_in_output": "include_stop_str_in_output is not supported",
}
NEUTRAL = {"modalities": ["text"], "n_probs": 0, "best_of": 1, "typical_p": 1, "mirostat": 0, "dry_multiplier": 0,
           "xtc_probability": 0, "dynatemp_range": 0, "min_tokens": 0, "include_stop_str_in_output": False,
           "top_n_sigma": -1}                                  # each refused field's value that changes nothing


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")   # other unknown fields (user, metadata...) are accepted and ignored

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0, le=MAX_INT)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=MAX_INT)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    repeat_last_n: int = Field(default=64, ge=-1, le=MAX_INT)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)   # vLLM's: over prompt and output
    n: int = Field(default=1, ge=1, le=16)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    ignore_eos: bool = False

    @model_validator(mode="after")
    def _repetition_penalty(self):
        """vLLM's repetition_penalty is llama.cpp's repeat_penalty over every token so far (repeat_last_n -1)."""
        if self.repetition_penalty is not None:
            if "repeat_penalty" in self.model_fields_set:
                raise ValueError("give repeat_penalty or repetition_penalty, not both")
            self.repeat_penalty = self.repetition_penalty
            if "repeat_last_n" not in self.model_fields_set:
                self.repeat_last_n = -1
        return self

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, v):
        for s in [v] if isinstance(v, str) else v or []:
            check_utf8(s)
        return v

    def refused_field(self) -> tuple[str, str] | None:
        """(field, why) for the first field set that this server cannot honour (REFUSED_FIELDS)."""
        for name, value in (self.model_extra or {}).items():
            if name in REFUSED_FIELDS:
                why = _refused(name, value)
                if why:
                    return name, why
        return None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            try:
                tid = int(key)
            except ValueError:
                raise ValueError(f"logit_bias keys are token ids, not '{key[:40]}'") from None
            if not -MAX_INT <= tid <= MAX_INT:
                raise ValueError(f"logit_bias token id {key[:40]} is out of range")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias values lie in [-100, 100], not {bias}")
        return v

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with integer token ids (None when absent or empty)."""
        return {int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None

    def grammar_source(self) -> tuple[str, dict] | None:
        """(the field, engine.grammar.compile_grammar's arguments) of the structured output the request asks for:
        OpenAI's response_format (json_object, json_schema) or llama-server's json_schema / grammar (GBNF); None
        for plain text. ValueError names a malformed one."""
        extra = self.model_extra or {}
        asked = [k for k in ("response_format", "json_schema", "grammar") if extra.get(k) not in (None, "", {})]
        fmt = extra.get("response_format")
        if isinstance(fmt, dict) and fmt.get("type") == "text" and fmt.keys() <= {"type"}:
            asked.remove("response_format")
        if not asked:
            return None
        if len(asked) > 1:
            raise ValueError(f"give one of response_format, json_schema and grammar, not {' and '.join(asked)}")
        name = asked[0]
        value = extra[name]
        if name == "grammar":
            if not isinstance(value, str):
                raise ValueError("'grammar' must be a GBNF grammar string")
            return name, {"gbnf": value}
        if name == "json_schema":
            if not isinstance(value, (dict, bool)):
                raise ValueError("'json_schema' must be a JSON schema object")
            return name, {"json_schema": value}
        kind = value.get("type") if isinstance(value, dict) else None
        if kind == "json_object":
            return name, {"json_object": True}
        if kind == "json_schema":
            spec = value.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise ValueError("response_format json_schema needs a 'json_schema' object with a 'schema'")
            return name, {"json_schema": spec.get("schema", {})}
        raise ValueError("response_format 'type' must be 'text', 'json_object' or 'json_schema'")

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]      # a list of texts or of token lists: several prompts
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    _prompt_text = field_validator("prompt")(classmethod(lambda cls, v: check_prompt(v)))


class LlamaCompletionRequest(_Sampling):
    """llama-server's native /completion body: its field names (n_predict, n_probs) and its sampling defaults."""
    prompt: str | list[int]
    n_predict: int = Field(default=-1, ge=-1, le=MAX_INT)        # -1: until the end of generation or the context
    n_probs: int = Field(default=0, ge=0, le=20)
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_k: int = Field(default=40, ge=0, le=MAX_INT)
    top_p: float = Field(default=0.95, ge=0.0, le=1.0)
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    cache_prompt: bool = True                                     # prompts are always prefix-cached

    _prompt_text = field_validator("prompt")(classmethod(lambda cls, v: check_prompt(v)))

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _pairs(cls, v):
        """llama-server also takes [[token, bias], ...]."""
        if isinstance(v, list):
            try:
                return {str(int(t)): float(b) for t, b in v}
            except (TypeError, ValueError):
                raise ValueError("logit_bias pairs are [token id, bias]") from None
        return v


class InfillChunk(BaseModel):
    model_config = ConfigDict(extra="forbid")
    filename: str = Field(default="", max_length=4096)
    text: str = ""


class InfillRequest(LlamaCompletionRequest):
    """llama-server's /infill: fill in between input_prefix and input_suffix (the model's fill-in-the-middle tokens),
    with other files' text as context (input_extra) and the start of the middle (prompt)."""
    prompt: str | list[int] = ""
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InfillChunk] = Field(default_factory=list, max_length=256)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None

    @field_validator("text")
    @classmethod
    def _text(cls, v):
        return v if v is None else check_utf8(v)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, v):
        if isinstance(v, str):
            return check_utf8(v)
        for part in v or []:
            if part.type != "text":
                raise ValueError(f"content parts of type '{part.type}' are not supported (text only)")
            if part.text is None:
                raise ValueError("a text content part needs a 'text' string")
        return v

    def as_dict(self) -> dict:
        """The message as a chat template takes it: role and text, and an assistant's tool_calls / a tool result's
        tool_call_id and name when given."""
        d = {"role": self.role, "content": self.text()}
        for key in ("tool_calls", "tool_call_id", "name"):
            value = (self.model_extra or {}).get(key)
            if value is not None:
                d[key] = value
        if d.get("tool_calls") is not None and not isinstance(d["tool_calls"], list):
            raise ValueError("tool_calls must be a list")
        return d

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0, le=MAX_INT)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    chat_template_kwargs: dict[str, Any] | None = None   # more variables for the chat template (vLLM, llama-server)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_names(cls, v):
        from engine.tokenizer import TEMPLATE_NAMES
        for name in v or {}:
            if not name.isidentifier():
                raise ValueError(f"chat_template_kwargs: {name[:40]!r} is not a template variable name")
            if name in TEMPLATE_NAMES:
                raise ValueError(f"chat_template_kwargs cannot set {name} (the request gives it)")
        return v


class TokenizeRequest(BaseModel):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False

    @field_validator("content")
    @classmethod
    def _text(cls, v):
        return check_utf8(v)


class DetokenizeRequest(BaseModel):
    tokens: list[int]


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "unavailable_error"}


class APIError(Exception):
    """An error answered in the OpenAI format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers
        self.type = type_ or ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}
