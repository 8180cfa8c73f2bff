"""Requests the server accepts, checked field by field, and OpenAI-style error bodies.

Bodies are validated with pydantic in strict mode (``"5"`` is not a number, ``true`` is not an
integer); fields this server does not implement are accepted when they carry their default
value (clients send ``presence_penalty: 0``, ``logprobs: false``, ``user``, ...) and refused with
a 400 naming the field otherwise. A wrong type is named (``temperature: expected a number, got
'hot'``); image content parts are refused (text only), and so is a string that is not valid
Unicode (an unpaired surrogate such as ``"\\ud800"``: JSON lets it through, tokenizers fail on it).
Every refusal is an :class:`ApiError`, which the app turns into
``{"error": {"message", "type", "param", "code"}}`` with its HTTP status.
"""

from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

__all__ = ["ApiError", "ChatRequest", "CompletionRequest", "parse", "error_body"]


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


Number = Union[StrictInt, StrictFloat]


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: StrictStr
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = Field(None, ge=0, le=2)
    top_p: Optional[Number] = Field(None, gt=0, le=1)
    n: Optional[StrictInt] = 1
    stream: Optional[StrictBool] = False
    stream_options: Optional[dict] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    seed: Optional[StrictInt] = None
    presence_penalty: Optional[Number] = 0
    frequency_penalty: Optional[Number] = 0
    logit_bias: Optional[dict] = None
    user: Optional[StrictStr] = None
    # extensions (as in vLLM): ignore the end-of-sequence token; return the token ids
    ignore_eos: Optional[StrictBool] = False
    return_token_ids: Optional[StrictBool] = False

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 4:
            raise ApiError(400, "at most 4 stop sequences are supported", param="stop")
        if any(s == "" for s in stops):
            raise ApiError(400, "stop sequences must not be empty", param="stop")
        return stops

    def check_common(self) -> None:
        if self.n not in (None, 1):
            raise ApiError(400, "only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise ApiError(400, f"{name} is not supported (only 0)", param=name)
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", param="logit_bias")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ApiError(400, "seed must be in [0, 2^63)", param="seed")
        for key in ("include_usage", "continuous_usage_stats"):
            if self.stream_options and not isinstance(self.stream_options.get(key, False), bool):
                raise ApiError(400, f"stream_options.{key} must be a boolean", param="stream_options")
        self.stops()

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    @property
    def continuous_usage(self) -> bool:
        """``stream_options.continuous_usage_stats`` (vLLM's extension) with ``include_usage``:
        every chunk carries the usage so far, one chunk per token (its text may be empty)."""
        return self.include_usage and bool(self.stream_options.get("continuous_usage_stats"))


class ContentPart(BaseModel):
    """One part of a message's content; :meth:`ChatRequest.check` accepts text parts only."""
    model_config = ConfigDict(extra="allow", strict=True)
    type: StrictStr
    text: Optional[StrictStr] = None


IMAGE_PARTS = ("image_url", "input_image", "image")


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Optional[Union[StrictStr, list[ContentPart]]] = None
    name: Optional[StrictStr] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatRequest(_Base):
    messages: list[Message] = Field(min_length=1)
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict] = None
    max_completion_tokens: Optional[StrictInt] = None

    def check(self) -> None:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        self.check_common()
        if self.logprobs or self.top_logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if self.tools:
            raise ApiError(400, "tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ApiError(400, "only response_format type 'text' is supported", param="response_format")
        for i, m in enumerate(self.messages):
            for j, part in enumerate(m.content if isinstance(m.content, list) else ()):
                where = f"messages[{i}].content[{j}]"
                if part.type in IMAGE_PARTS:
                    raise ApiError(400, f"{where}: images are not supported", param=where)
                if part.type != "text":
                    raise ApiError(400, f"{where}: content parts of type {part.type!r} are not supported "
                                   "(only 'text')", param=where)
                if part.text is None:
                    raise ApiError(400, f"{where}.text: a text part needs its text", param=f"{where}.text")

    def conversation(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Base):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    echo: Optional[StrictBool] = False
    logprobs: Optional[StrictInt] = None
    best_of: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None

    def check(self) -> None:
        self.check_common()
        if self.echo:
            raise ApiError(400, "echo is not supported", param="echo")
        if self.logprobs:
            raise ApiError(400, "logprobs are not supported", param="logprobs")
        if self.best_of not in (None, 1):
            raise ApiError(400, "only best_of=1 is supported", param="best_of")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", param="suffix")

    def single_prompt(self) -> Union[str, list[int]]:
        """The one prompt (text or token ids); a list of several prompts is refused (n=1 only)."""
        p = self.prompt
        if isinstance(p, str):
            return p
        if not p:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return list(p)
        if len(p) != 1:
            raise ApiError(400, "one prompt per request is supported (send several requests)", param="prompt")
        return p[0] if isinstance(p[0], str) else list(p[0])


def parse(cls, data) -> Any:
    """``cls`` from a decoded JSON body, or an :class:`ApiError` naming the first bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object")
    bad = _surrogate(data)
    if bad is not None:
        raise ApiError(400, f"{bad or 'body'}: not valid Unicode (an unpaired surrogate)", param=bad or None)
    try:
        obj = cls.model_validate(data)
    except ValidationError as exc:
        errs = [(_loc(e.get("loc", ())), e) for e in exc.errors()]
        # a union answers once per member: keep the first field's deepest errors (the member that
        # got furthest) and name the types they expect
        head = errs[0][0]
        mine = [(loc, e) for loc, e in errs if loc[:len(head)] == head]
        loc = max((loc for loc, _ in mine), key=len)
        same = [e for at, e in mine if at == loc]
        wants = [_EXPECTED.get(e["type"]) for e in same]
        if all(wants):
            if "a number" in wants:  # int | float
                wants = [w for w in wants if w != "an integer"]
            wants = list(dict.fromkeys(wants))
            either = wants[0] if len(wants) == 1 else ", ".join(wants[:-1]) + " or " + wants[-1]
            msg = f"expected {either}, got {_got(same[0].get('input'))}"
        else:
            msg = same[0].get("msg", "invalid value")
        path = _path(loc)
        raise ApiError(400, f"{path or 'body'}: {msg}", param=path or None) from None
    obj.check()
    return obj


_EXPECTED = {"int_type": "an integer", "float_type": "a number", "string_type": "a string", "bool_type": "a boolean",
             "list_type": "a list", "dict_type": "an object", "model_type": "an object"}


def _loc(loc) -> tuple:
    """A pydantic location without the entries that name a union member's type (``str``, ``list[int]``)."""
    return tuple(x for x in loc if not (isinstance(x, str) and (
        "[" in x or x in {"str", "int", "float", "bool", "dict", "ContentPart"})))


def _path(loc) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content``."""
    return "".join(f"[{x}]" if isinstance(x, int) else (f".{x}" if i else str(x)) for i, x in enumerate(loc))


def _got(value) -> str:
    """A bad value, short, for an error message."""
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # an unpaired surrogate
        return False
    return True


def _surrogate(data) -> str | None:
    """Where a string holding an unpaired surrogate is (``messages[0].content``), or None."""
    todo = [((), data)]
    while todo:  # not recursive: a deeply nested body is no stack overflow
        loc, node = todo.pop()
        inner = []
        for key, value in (node.items() if isinstance(node, dict) else enumerate(node)):
            if isinstance(key, str) and not _unicode(key):
                return _path(loc)
            if isinstance(value, str) and not _unicode(value):
                return _path(loc + (key,))
            if isinstance(value, (dict, list)):
                inner.append((loc + (key,), value))
        todo.extend(reversed(inner))
    return None
