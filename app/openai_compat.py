"""The OpenAI-compatible protocol's wire shapes: models, answers, chunk streams, errors.

vLLM, llama.cpp's server and ``transformers serve`` speak it, and so do the official
SDKs and many load generators; serving it lets those clients use streamscope. The
routes (``openai_routes.py``) run on the same hub, streams and disconnect path as
``/v1/stream``; the request bodies are in ``openai_schemas.py``. Only the JSON differs:

* a whole answer: one ``text_completion`` (``choices[0].text``) or ``chat.completion``
  (``choices[0].message``, role ``assistant``) with ``finish_reason`` and ``usage``;
* a stream: ``data:`` lines only, one ``id`` and ``created`` for the whole stream. Chat
  opens with a chunk whose delta is ``{"role": "assistant", "content": ""}``; then one
  chunk per token (the text delta, ``finish_reason`` null), a last chunk with the finish
  reason, with ``stream_options.include_usage`` one more chunk with ``choices: []`` and
  the totals (every other chunk's ``usage`` is null), then ``data: [DONE]``.

No ``event:``, ``id:`` or ``retry:`` line ever: the SDK's decoder parses every block it
dispatches as JSON (openai-python issues 2722 and 3833). Keep-alives are comment lines
(``sse_body.KEEPALIVE_COMMENT``), which it ignores. A failure after the first byte is
``data: {"error": {...}}`` then ``data: [DONE]``, as vLLM sends it; the SDK raises it as
``APIError``.

Errors are OpenAI's object ``{"error": {"message", "type", "param", "code"}}``: ``code``
is our ``ErrorType`` value (``model_not_found``, ``too_many_waiting``, ...), ``type``
OpenAI's class of error, ``param`` the offending field or null. A request the server
cannot accept is a 400 here (OpenAI's status), where our own routes answer 422. Every
429 and 503 carries ``Retry-After``; ``x-should-retry: false`` (a header the SDKs obey)
marks the answers a retry cannot change: a client error, a server that failed, a bug.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import pydantic

from engine import FinishEvent, FinishReason, TokenEvent
from streams import StreamError, StreamItem, encode_event

from .errors import STATUS, ApiError, ErrorType, api_error_for
from .sse_body import EventStreamBody, ItemSource

if TYPE_CHECKING:
    from quart import Response

    from .metrics import RequestTimer

DONE = encode_event("[DONE]")
OWNED_BY = "streamscope"

# eos and stop strings are both "stop" in OpenAI's vocabulary.
FINISH_REASONS = {
    FinishReason.EOS: "stop",
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
}

# OpenAI answers a request it cannot accept with 400, where our routes say 422.
_OPENAI_STATUS = {
    ErrorType.INVALID_JSON: 400,
    ErrorType.INVALID_REQUEST: 400,
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

    def to_response(self) -> Response:
        response = super().to_response()
        if "Retry-After" not in response.headers and self.status in (429, 503):
            response.headers["Retry-After"] = "1"
        if self.status not in _RETRYABLE_STATUS and (
            self.status < 500 or self.type in _NOT_RETRYABLE
        ):
            response.headers["x-should-retry"] = "false"
        return response


def openai_error_for(exc: BaseException) -> OpenAIError:
    """The OpenAI-shaped answer to ``exc`` (``api_error_for`` chooses its type)."""
    if isinstance(exc, OpenAIError):
        return exc
    param = _param(exc) if isinstance(exc, pydantic.ValidationError) else None
    return OpenAIError(api_error_for(exc), param=param)


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
        name: the model setting's value, always served.
        alias: another name clients may use; ``*`` accepts any name.
        created: the Unix time ``/v1/models`` reports (the server's start).
    """

    name: str
    alias: str | None
    created: int

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
        """The name the answer carries: the requested one if served, the model's own if
        none was given.

        Raises:
            OpenAIError: model_not_found (404).
        """
        if not requested:
            return self.name
        if self.alias == "*" or requested in self.ids:
            return requested
        raise OpenAIError(
            ApiError(ErrorType.MODEL_NOT_FOUND,
                     f"the model {requested[:128]!r} does not exist here; this server "
                     f"serves {', '.join(self.ids)} (GET /v1/models)"),
            param="model",
        )


# -- answers: one shape per route ---------------------------------------------------------


class ChoiceShape(Protocol):
    """How one route writes its answers and chunks."""

    object_name: str  # the whole answer's "object"
    chunk_object_name: str  # each chunk's "object"
    id_prefix: str

    def whole_choice(self, text: str, finish_reason: str) -> dict[str, Any]: ...
    def first_choice(self) -> dict[str, Any] | None:
        """The choice of a chunk sent before any token, or None for no such chunk."""
        ...

    def delta_choice(self, text: str) -> dict[str, Any]: ...
    def last_choice(self, finish_reason: str) -> dict[str, Any]: ...


class CompletionShape:
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def whole_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def first_choice(self) -> dict[str, Any] | None:
        return None

    def delta_choice(self, text: str) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": None}

    def last_choice(self, finish_reason: str) -> dict[str, Any]:
        return {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}


class ChatShape:
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def whole_choice(self, text: str, finish_reason: str) -> dict[str, Any]:
        message = {"role": "assistant", "content": text, "refusal": None}
        return {"index": 0, "message": message, "logprobs": None,
                "finish_reason": finish_reason}

    def first_choice(self) -> dict[str, Any] | None:
        return self._delta({"role": "assistant", "content": ""}, None)

    def delta_choice(self, text: str) -> dict[str, Any]:
        return self._delta({"content": text}, None)

    def last_choice(self, finish_reason: str) -> dict[str, Any]:
        return self._delta({}, finish_reason)

    @staticmethod
    def _delta(delta: dict[str, Any], finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


COMPLETION = CompletionShape()
CHAT = ChatShape()


def whole_answer(
    shape: ChoiceShape, request_id: str, model: str, text: str, finish: FinishEvent
) -> dict[str, Any]:
    """The answer of a request without ``"stream": true``."""
    return {
        "id": shape.id_prefix + request_id,
        "object": shape.object_name,
        "created": int(time.time()),
        "model": model,
        "choices": [shape.whole_choice(text, FINISH_REASONS[finish.reason])],
        "usage": usage(finish),
    }


def usage(finish: FinishEvent) -> dict[str, int]:
    return {
        "prompt_tokens": finish.prompt_tokens,
        "completion_tokens": finish.completion_tokens,
        "total_tokens": finish.prompt_tokens + finish.completion_tokens,
    }


class OpenAIChunksBody(EventStreamBody):
    """``/v1/stream``'s body with OpenAI's chunks on the wire instead of our events.

    Args:
        shape: the route's chunks (``COMPLETION`` or ``CHAT``).
        model: the name every chunk carries.
        include_usage: ``stream_options.include_usage``.
        (the rest as ``EventStreamBody``)
    """

    def __init__(
        self,
        stream: ItemSource,
        *,
        keepalive_s: float,
        shape: ChoiceShape,
        model: str,
        include_usage: bool = False,
        timer: RequestTimer | None = None,
    ) -> None:
        super().__init__(stream, keepalive_s=keepalive_s, timer=timer)
        self.shape = shape
        self.model = model
        self.include_usage = include_usage
        self.created = int(time.time())  # Invariant: one id and created per stream

    def _opening(self) -> bytes:
        choice = self.shape.first_choice()
        return b"" if choice is None else self._chunk([choice])

    def _encode(self, item: StreamItem) -> bytes:
        match item:
            case TokenEvent():
                return self._chunk([self.shape.delta_choice(item.text)])
            case FinishEvent():
                self.is_finished = True
                last = self._chunk([self.shape.last_choice(FINISH_REASONS[item.reason])])
                if self.include_usage:
                    last += self._chunk([], usage=usage(item))
                return last + DONE
            case StreamError():
                self.is_finished = True
                return self._error(item.type, item.message)
        raise TypeError(f"not a stream item: {item!r}")

    def _error(self, error_type: str, message: str) -> bytes:
        try:
            kind = ErrorType(error_type)
        except ValueError:
            kind = ErrorType.INTERNAL_ERROR
        return _data(OpenAIError(ApiError(kind, message)).envelope()) + DONE

    def _chunk(
        self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None
    ) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.shape.id_prefix + self.stream.request_id,
            "object": self.shape.chunk_object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            chunk["usage"] = usage
        return _data(chunk)


def _data(payload: dict[str, Any]) -> bytes:
    # ensure_ascii: see sse_body.encode_json_event (no U+2028 for line splitters).
    return encode_event(json.dumps(payload, ensure_ascii=True, separators=(",", ":")))
