"""The Anthropic Messages protocol's errors: ``AnthropicError``, ``anthropic_error_for``.

Errors are Anthropic's object ``{"type": "error", "error": {"type", "message"}}``, where
``error.type`` is Anthropic's class of error, chosen by the status:

    400  invalid_request_error   a body this server cannot accept (our 422s, too)
    401  authentication_error    no API key, or a wrong one (x-api-key or bearer)
    404  not_found_error         no such model (or route)
    408  timeout_error           the body did not arrive in time
    413  request_too_large       over STREAMSCOPE_MAX_BODY_BYTES
    429  rate_limit_error        the API key's stream limit; a TTFT deadline unmeetable
    529  overloaded_error        the waiting limit, a draining server, a TTFT deadline
                                 missed while waiting (our 429 / 503)
    5xx  api_error               the engine failed, the model still loads, a bug
    4xx  invalid_request_error   any other

Our own ``ErrorType`` value (``too_many_waiting``, ...) leads the message, so a person
reading it knows which limit it was. Every 429, 503 and 529 carries ``Retry-After``
(the SDK waits that long before it retries); ``x-should-retry: false``, which the SDK
obeys as the OpenAI SDK does, marks the answers a retry cannot change. A failure after
a stream's first byte is the same object as an ``error`` event (``app.wire``).
"""

from __future__ import annotations

from typing import Any

from ..error_handlers import api_error_for
from ..errors import STATUS, ApiError, ErrorType

# Anthropic answers a request it cannot accept with 400, where our routes say 422; a
# server that cannot take more work now says 529 (overloaded), where ours says 429/503.
_ANTHROPIC_STATUS = {
    ErrorType.INVALID_JSON: 400,
    ErrorType.INVALID_REQUEST: 400,
    ErrorType.INVALID_CONSTRAINT: 400,
    ErrorType.PROMPT_TOO_LONG: 400,
    ErrorType.TOO_MANY_WAITING: 529,
    ErrorType.SHUTDOWN: 529,
    ErrorType.DEADLINE_MISSED: 529,
}
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
# Retry-After for the answers that come without one (as the OpenAI routes send them).
_DEFAULT_RETRY_AFTER_S = {
    ErrorType.NOT_READY: 5.0,
    ErrorType.UNAVAILABLE: 30.0,
}
_WAIT_STATUS = frozenset({429, 503, 529})
# Statuses a retry may change: the SDK retries them by default, and should.
_RETRYABLE_STATUS = frozenset({408, 409, 429})
# 500 and 503 that a retry of this request on this server cannot change.
_NOT_RETRYABLE = frozenset({ErrorType.UNAVAILABLE, ErrorType.INTERNAL_ERROR})


def anthropic_status(error_type: ErrorType) -> int:
    """The status an error of this type has on these routes."""
    return _ANTHROPIC_STATUS.get(error_type, STATUS[error_type])


def anthropic_type(status: int) -> str:
    """Anthropic's class of error for a status (the module docstring's table)."""
    return _TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


class AnthropicError(ApiError):
    """An ``ApiError`` answered in Anthropic's shape and status (the module docstring)."""

    def __init__(self, error: ApiError) -> None:
        retry_after_s = error.retry_after_s
        if retry_after_s is None:
            retry_after_s = _DEFAULT_RETRY_AFTER_S.get(error.type)
        super().__init__(error.type, error.message, retry_after_s=retry_after_s,
                         allow=error.allow, detail=error.detail)

    @property
    def status(self) -> int:
        return anthropic_status(self.type)

    def envelope(self) -> dict[str, Any]:
        return anthropic_error_envelope(self.type, self.message, self.detail)

    def headers(self) -> dict[str, str]:
        headers = super().headers()
        status = self.status
        if "Retry-After" not in headers and status in _WAIT_STATUS:
            headers["Retry-After"] = "1"
        if status not in _RETRYABLE_STATUS and (status < 500 or self.type in _NOT_RETRYABLE):
            headers["x-should-retry"] = "false"
        return headers


def anthropic_error_envelope(
    error_type: ErrorType, message: str, detail: dict[str, object] | None = None
) -> dict[str, Any]:
    """The error object of a refusal, or of a failure after a stream's first byte."""
    kind = anthropic_type(anthropic_status(error_type))
    return {"type": "error",
            "error": {"type": kind, "message": f"{error_type.value}: {message}",
                      **(detail or {})}}


def anthropic_error_for(exc: BaseException) -> AnthropicError:
    """The Anthropic-shaped answer to ``exc`` (``api_error_for`` chooses its type)."""
    if isinstance(exc, AnthropicError):
        return exc
    return AnthropicError(api_error_for(exc))
