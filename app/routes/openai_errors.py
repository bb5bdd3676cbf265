"""The OpenAI-compatible protocol's errors and model names: ``OpenAIError``,
``openai_error_for``, ``refuse_effort_the_template_reads``, ``ServedModels``.

Errors are OpenAI's object ``{"error": {"message", "type", "param", "code"}}``: ``code``
is our ``ErrorType`` value (``model_not_found``, ``too_many_waiting``, ...), ``type``
OpenAI's class of error, ``param`` the offending field or null. A request the server
cannot accept is a 400 here (OpenAI's status), where our own routes answer 422. Every
429 and 503 carries ``Retry-After``; ``x-should-retry: false`` (a header the SDKs obey)
marks the answers a retry cannot change: a client error, a server that failed, a bug.
A failure after a stream's first byte is the same object in a ``data:`` line
(``openai_error_envelope``), then ``data: [DONE]``, as vLLM sends it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

import pydantic

from engine import InvalidRequest

from ..error_handlers import api_error_for
from ..errors import STATUS, ApiError, ErrorType
from ..runtime import ServingEngine

OWNED_BY = "streamscope"

# OpenAI answers a request it cannot accept with 400, where our routes say 422.
_OPENAI_STATUS = {
    ErrorType.INVALID_JSON: 400,
    ErrorType.INVALID_REQUEST: 400,
    ErrorType.INVALID_CONSTRAINT: 400,
    ErrorType.PROMPT_TOO_LONG: 400,
}
_OPENAI_TYPES = {401: "authentication_error", 429: "rate_limit_error"}
# Retry-After for the 429 and 503 answers that come without one: a model still loading
# takes seconds; a failed engine needs its process restarted (by then, a new one).
_DEFAULT_RETRY_AFTER_S = {
    ErrorType.NOT_READY: 5.0,
    ErrorType.UNAVAILABLE: 30.0,
}
# Statuses a retry may change: the SDK retries them by default, and should.
_RETRYABLE_STATUS = frozenset({408, 409, 429})
# 500 and 503 that a retry of this request on this server cannot change.
_NOT_RETRYABLE = frozenset({ErrorType.UNAVAILABLE, ErrorType.INTERNAL_ERROR})


class OpenAIError(ApiError):
    """An ``ApiError`` answered in OpenAI's shape and status (see the module docstring).

    Args:
        param: the request field at fault, or None.
    """

    def __init__(self, error: ApiError, *, param: str | None = None) -> None:
        retry_after_s = error.retry_after_s
        if retry_after_s is None:
            retry_after_s = _DEFAULT_RETRY_AFTER_S.get(error.type)
        super().__init__(error.type, error.message, retry_after_s=retry_after_s,
                         allow=error.allow, detail=error.detail)
        self.param = param

    @property
    def status(self) -> int:
        return _OPENAI_STATUS.get(self.type, STATUS[self.type])

    def envelope(self) -> dict[str, Any]:
        status = self.status
        kind = _OPENAI_TYPES.get(status, "server_error" if status >= 500
                                 else "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.type.value, **self.detail}}

    def headers(self) -> dict[str, str]:
        headers = super().headers()
        if "Retry-After" not in headers and self.status in (429, 503):
            headers["Retry-After"] = "1"
        if self.status not in _RETRYABLE_STATUS and (
            self.status < 500 or self.type in _NOT_RETRYABLE
        ):
            headers["x-should-retry"] = "false"
        return headers


def openai_error_envelope(error_type: ErrorType, message: str) -> dict[str, Any]:
    """The error object of a failure after a stream's first byte (no param)."""
    return OpenAIError(ApiError(error_type, message)).envelope()


def openai_error_for(exc: BaseException) -> OpenAIError:
    """The OpenAI-shaped answer to ``exc`` (``api_error_for`` chooses its type)."""
    if isinstance(exc, OpenAIError):
        return exc
    param = (_param(exc) if isinstance(exc, pydantic.ValidationError)
             else getattr(exc, "param", None) if isinstance(exc, InvalidRequest) else None)
    return OpenAIError(api_error_for(exc), param=param)


def refuse_effort_the_template_reads(engine: ServingEngine | None, effort: str | None,
                                     param: str) -> None:
    """A reasoning effort (chat's ``reasoning_effort``, Responses' ``reasoning.effort``)
    is accepted, and changes nothing, where the model's chat template has no use for it
    (as vLLM does: ``app.schemas.hints``); a template that reads it would be rendered
    without it, so there it is refused, a 400 naming ``param``. Sync.

    Raises: OpenAIError."""
    if effort is not None and engine is not None and \
            engine.chat_template_uses("reasoning_effort"):
        raise OpenAIError(ApiError(
            ErrorType.INVALID_REQUEST, f"this model's chat template reads reasoning_effort, "
            f"which this server does not pass to it: send {param} null or leave it out"),
            param=param)


def _param(exc: pydantic.ValidationError) -> str | None:
    """The first problem's field, written as OpenAI does: ``messages[0].content``."""
    problems = exc.errors(include_url=False, include_input=False)
    if not problems or problems[0]["type"] == "json_invalid" or not problems[0]["loc"]:
        return None
    parts = []
    for part in problems[0]["loc"]:
        if isinstance(part, str) and (part in _UNION_TAGS or "[" in part):
            break  # pydantic names the union member it tried: not a field
        parts.append(f"[{part}]" if isinstance(part, int) else f".{part}")
    return "".join(parts).removeprefix(".")


# The loc entries pydantic adds for the members of a union (``str | list[TextPart]``).
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})


@dataclass(frozen=True)
class ServedModels:
    """The model names the OpenAI routes answer to (``STREAMSCOPE_MODEL_NAME``).

    Args:
        model: the model setting's value: a built-in name or a local folder, served as
            its folder's name (``shown``), never its path, which says something of the
            server's disk to every key holder (issue 33). The path is still accepted.
        alias: another name clients may use; ``*`` accepts any name.
        created: the Unix time ``/v1/models`` reports (the server's start).
    """

    model: str
    alias: str | None
    created: int

    @property
    def name(self) -> str:
        """The model's own name in every answer: the setting's last path component."""
        return PurePath(self.model).name

    @property
    def ids(self) -> list[str]:
        extra = [self.alias] if self.alias not in (None, "*", self.name) else []
        return [self.name, *extra]

    def listing(self) -> dict[str, Any]:
        """``GET /v1/models``."""
        return {"object": "list", "data": [self.card(i) for i in self.ids]}

    def card(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": self.created,
                "owned_by": OWNED_BY}

    def check(self, requested: str | None) -> str:
        """The name the answer carries: the requested one if it is one of ``ids``, else
        the model's own. With ``*`` any name is accepted but not echoed: a client's
        string (up to the body's size) would be repeated in every chunk; OpenAI's API
        too answers with its own name for the model asked for.

        Raises:
            OpenAIError: model_not_found (404).
        """
        if requested in self.ids:
            return requested
        if not requested or self.alias == "*" or requested == self.model:
            return self.name
        raise OpenAIError(
            ApiError(ErrorType.MODEL_NOT_FOUND,
                     f"the model {requested[:128]!r} does not exist here; this server "
                     f"serves {', '.join(self.ids)} (GET /v1/models)"),
            param="model",
        )
