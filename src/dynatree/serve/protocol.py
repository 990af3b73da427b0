"""The OpenAI-compatible request bodies the server accepts, and OpenAI's error format.

pydantic validates types and ranges (an unknown field, a negative `max_tokens`, `n` other than 1
are 400s); what depends on the loaded models (context length, the method's options, the draft)
is checked by `api.prepare` when the request is prepared. Fields OpenAI defines that change
nothing here (`user`) are accepted; fields whose non-default values dynatree cannot honour
(penalties, `echo`, `suffix`, tools) are 400s when set to anything else, never silently
ignored; every field neither OpenAI nor this server (`top_k`, `dynatree`) defines (vLLM's
`repetition_penalty`, ...) is a 400. Text must be
valid Unicode (JSON can carry a lone surrogate, which no tokenizer encodes).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from ..request import Role, template_role

MAX_STOPS = 4  # OpenAI's limit on `stop` strings
MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's top_logprobs bound; request.MAX_LOGPROBS)


class _Strict(BaseModel):
    # strict: "0.5" is not a number, true is not an integer; no NaN or infinities from JSON
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _unicode(text: str, what: str) -> str:
    """`text` if it is valid Unicode; JSON's "\\ud800" escapes give a lone surrogate, which UTF-8 cannot hold."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{what} is not valid Unicode: a lone surrogate {text[exc.start]!r} at character {exc.start}") from None
    return text


def _only_neutral(name: str, value, neutral: tuple) -> None:
    """An OpenAI field this server has no use for, accepted only as null or one of the `neutral` values
    that ask for nothing (of the same type: `true` is not 1); otherwise a ValueError naming it."""
    if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
        raise ValueError(f"{name} is not supported by this server (got {value!r}"
                         + (f"; accepted: null, {', '.join(map(repr, neutral))})" if neutral else ")"))


def _whole(value):
    """A float with no fraction (`5.0`, as Python's json writes a number that went through a float) as
    the integer it is; anything else as it came (the strict type check then names a fraction or a string)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class TextPart(_Strict):
    """One part of a message's content given as a list (only text parts exist in a text model)."""

    type: Literal["text"]
    text: str


class Message(_Strict):
    """One chat message; `developer` is OpenAI's newer name for `system`."""

    role: Role  # (the Python API's roles: request.Role)
    content: str | list[TextPart] | None = None  # None only for an assistant message (as OpenAI returns some)
    name: str | None = None  # accepted, not used by chat templates
    # what a client sends back when it appends a response's message to the conversation: accepted when empty
    refusal: str | None = None
    tool_calls: list | None = None
    function_call: Any = None
    audio: Any = None
    annotations: list | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, content):
        if isinstance(content, list):
            for part in content:
                if isinstance(part, TextPart):
                    part = part.model_dump()
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError("only text content parts are supported by this (text) model, got "
                                     + (f"a part of type {kind!r}" if isinstance(kind, str) else f"{part!r}"))
                if isinstance(part.get("text"), str):
                    _unicode(part["text"], "the text")
        elif isinstance(content, str):
            _unicode(content, "the text")
        elif content is not None:
            raise ValueError(f"content must be a string or a list of text parts, got {type(content).__name__}")
        return content

    @model_validator(mode="after")
    def _text_only(self):
        # what a client sends back when it appends a response's message to the conversation
        for name, neutral in (("refusal", ()), ("tool_calls", ([],)), ("function_call", ()), ("audio", ()),
                              ("annotations", ([],))):
            _only_neutral(name, getattr(self, name), neutral)
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_template_message(self) -> dict:
        return {"role": template_role(self.role), "content": self.text()}


class StreamOptions(_Strict):
    include_usage: bool = False  # a last chunk with `usage` before [DONE]


# OpenAI's nullable fields whose default is not null: a null there means the default (clients that send
# every field, unset ones as null, must not get a 400 for it)
NULL_MEANS_DEFAULT = ("temperature", "top_p", "n", "stream", "presence_penalty", "frequency_penalty", "echo")
# OpenAI's fields this server has no use for, and the values of each that ask for nothing it lacks (no tools,
# one candidate, text out); null means unused too. Any other value is a 400 naming the field, never ignored.
UNUSED = {"best_of": (1,), "service_tier": ("auto", "default"), "tools": ([],), "tool_choice": ("none", "auto"),
          "parallel_tool_calls": (True, False), "functions": ([],), "function_call": ("none", "auto"),
          "prediction": (), "modalities": (["text"],), "reasoning_effort": (), "audio": (), "web_search_options": ()}


class _Request(_Strict):
    """Fields chat and text completions share."""

    model: str
    max_tokens: int | None = Field(None, ge=1)  # absent: up to the context and the server's --max-tokens
    temperature: float = Field(1.0, ge=0.0, le=2.0)  # 0: greedy (exact: the target's own greedy tokens)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)  # an extension (vLLM and llama.cpp have it too); -1 or 0: all tokens (vLLM's)
    seed: int | None = Field(None, ge=-2**63, lt=2**63)  # absent: a fresh random seed per request
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None  # chat: true/false (with top_logprobs); text completions: how many alternatives
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    logit_bias: dict | None = None
    response_format: dict | None = None
    metadata: dict | None = None
    store: bool | None = None
    dynatree: dict[str, Any] | None = None  # {"method": NAME, OPTION: VALUE, ...} as the CLI's flags
    # OpenAI's fields for what a text-only, one-candidate server lacks: accepted only as `UNUSED` allows
    best_of: Any = None
    service_tier: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    prediction: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    audio: Any = None
    web_search_options: Any = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data):
        if isinstance(data, dict):
            return {k: v for k, v in data.items()
                    if not (v is None and k in NULL_MEANS_DEFAULT and k in cls.model_fields)}
        return data

    # (check_fields=False: max_completion_tokens is chat's field, an integer logprobs text completions')
    @field_validator("max_tokens", "seed", "n", "top_logprobs", "max_completion_tokens", "logprobs", mode="before",
                     check_fields=False)
    @classmethod
    def _whole_numbers(cls, value):
        return _whole(value)

    @field_validator("top_k", mode="before")
    @classmethod
    def _all_tokens(cls, value):
        value = _whole(value)
        return None if value in (-1, 0) and not isinstance(value, bool) else value  # vLLM's "no top-k"

    @field_validator(*UNUSED)
    @classmethod
    def _nothing_unused_asked(cls, value, info: ValidationInfo):
        _only_neutral(info.field_name, value, UNUSED[info.field_name])
        return value

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"n must be 1: tree speculation decodes one sequence per request (got {n})")
        return n

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_type(cls, stop):
        if not (stop is None or isinstance(stop, str) or isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        return stop

    @field_validator("stop")
    @classmethod
    def _stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return [_unicode(s, "a stop string") for s in stops]

    # what dynatree cannot honour, checked field by field so that the error names its `param`
    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float, info: ValidationInfo) -> float:
        if value:
            raise ValueError(f"{info.field_name} is not supported: it changes the target's distribution, which "
                             "tree verification keeps exact (leave it 0)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, value):
        if value:
            raise ValueError("logit_bias is not supported: it changes the target's distribution")
        return value

    @field_validator("response_format")
    @classmethod
    def _text_format(cls, value):
        if value not in (None, {"type": "text"}):
            raise ValueError("response_format other than text is not supported by this server")
        return value

    @field_validator("stream_options")
    @classmethod
    def _with_stream(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("stream", False):
            raise ValueError("stream_options applies only with stream: true")
        return value

    @property
    def stops(self) -> list[str]:
        return self.stop or []  # a list once validated (a default None is not validated)

    @property
    def asked_logprobs(self) -> int | None:
        """How many alternatives to list beside each new token's log-probability; None: no logprobs."""
        raise NotImplementedError


class ChatRequest(_Request):
    """POST /v1/chat/completions: `messages` go through the tokenizer's chat template."""

    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool | None = None  # each new token's log-probability (top_logprobs: alternatives beside it)

    @field_validator("max_completion_tokens")
    @classmethod
    def _agrees(cls, value, info: ValidationInfo):
        given = info.data.get("max_tokens")
        if value is not None and given is not None and given != value:
            raise ValueError("max_tokens and max_completion_tokens disagree; give one of them")
        return value

    @model_validator(mode="after")
    def _one_limit(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value, info: ValidationInfo):
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @property
    def asked_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    """POST /v1/completions: `prompt` is plain text (one string), or token ids."""

    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each new token's log-probability, this many alternatives

    @field_validator("top_logprobs")
    @classmethod
    def _chat_only(cls, value):
        if value is not None:
            raise ValueError("top_logprobs is a chat completions field; text completions take logprobs: N")
        return value

    @property
    def asked_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_type(cls, prompt):
        ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
        texts = isinstance(prompt, list) and all(isinstance(t, str) for t in prompt)
        if not (isinstance(prompt, str) or ids or texts):
            raise ValueError("prompt must be a string, a list of one string or a list of token ids "
                             f"(one prompt per request), got {prompt!r}"[:300])
        return prompt

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request (got {len(prompt)}): send one request per prompt")
            prompt = prompt[0]
        if not prompt:
            raise ValueError("the prompt is empty")
        return _unicode(prompt, "the prompt") if isinstance(prompt, str) else prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        if value:
            raise ValueError("echo is not supported by this server")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value):
        if value:
            raise ValueError("suffix (insertion) is not supported by this server")
        return value


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object, as its clients parse it."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """One line from pydantic's errors (the first), and the parameter it names."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if first.get("type") in ("model_type", "model_attributes_type", "dict_type") and not loc:
        return ("the request body must be a JSON object (sent with Content-Type: application/json)", None)
    if first.get("type") == "extra_forbidden":
        return f"unknown field {param!r}", param
    if first.get("type") == "missing":
        return (f"missing field {param!r}", param) if param else ("the request has no JSON body", None)
    named = param and not re.match(rf"{re.escape(param)}\b", message)  # "n: n must be 1" reads twice
    return (f"{param}: {message}" if named else message), param
