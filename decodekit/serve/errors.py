"""The server's errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`, and which request field
a decodekit error message is about (its key path: `processors[2].logit_bias...`, `strategy.beam_search...`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from decodekit.api.params import SamplingParams

_KEY = re.compile(r"(processors|stopping)\[(\d+)\]")
_FIELD = re.compile(r"`?([a-z_]+)`?[: ]")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})  # union branches in error locations


class APIError(Exception):
    """An error answered with an HTTP status and OpenAI's error JSON.

    Args:
        status: the HTTP status (400, 401, 404, 413, 429, 500).
        message: what is wrong, for a person.
        type: OpenAI's error type (`invalid_request_error`, `server_error`, ...).
        param: the request field it is about, if any.
        code: OpenAI's error code (`model_not_found`, `invalid_api_key`, ...), if any.
        headers: extra response headers (e.g. Retry-After).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def validation_error(exc: ValidationError) -> APIError:
    """A 400 for a request body pydantic refused, naming the first field at fault (`messages[0].role`)."""
    first = exc.errors()[0]
    param = location(first["loc"])
    if param.split(".")[0].split("[")[0] == "prompt" and first["type"] not in ("missing", "too_short"):
        return APIError(400, "prompt: expected a text, a list of texts, a list of token ids (integers) or a list of "
                             "token-id lists", param="prompt")
    message = first["msg"]
    if "input" in first and first["type"] != "missing":
        got = repr(first["input"])
        message = f"{message}, got {got if len(got) <= 80 else got[:77] + '...'}"
    return APIError(400, f"{param}: {message}" if param else message, param=param or None)


def location(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a field path: ("messages", 0, "role") -> "messages[0].role" (union branch tags
    such as `str` or `list[int]` left out)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part not in _TYPE_TAGS and "[" not in part:
            path += f".{part}" if path else part
    return path


def param_of(message: str, params: SamplingParams | None, origins: Mapping[str, str], prompt_field: str
             ) -> str | None:
    """The request field a decodekit error is about, from the key path its message starts with.

    Args:
        message: the error (`processors[2].logit_bias.bias.5: ...`, `strategy.beam_search: ...`, `temperature: ...`).
        params: the request's merged parameters (to find which processor `processors[2]` is), or None when the
            message indexes the request's own lists.
        origins: which request field asked for what: `processors:NAME` / `stopping:NAME` -> field, and sampling
            field -> request field (`max_tokens` -> `max_completion_tokens`).
        prompt_field: `messages` or `prompt`, for errors about the prompt.
    """
    key = _KEY.match(message)
    if key:
        kind, index = key[1], int(key[2])
        specs = (params.processors if kind == "processors" else params.stopping) if params is not None else None
        if specs is None:
            return kind
        if index < len(specs):
            return origins.get(f"{kind}:{specs[index].name}")
        return kind
    if message.startswith("strategy"):
        return "strategy"
    if message.startswith("reasoning"):  # the field that set the key (`thinking_token_budget`, ...), else `reasoning`
        path = message.split(":", 1)[0]
        keys = sorted((k for k in origins if k.startswith("reasoning") and path.startswith(k)), key=len)
        return origins[keys[-1]] if keys else "reasoning"
    if message.startswith(("the prompt", "request needs")):  # too long, not tokenizable, too big for the KV cache
        return prompt_field
    field = _FIELD.match(message)
    if field and field[1] in SamplingParams.model_fields:
        return origins.get(field[1], field[1])
    return None
