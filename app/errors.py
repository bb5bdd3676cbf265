"""The error envelope, and the one table that chooses each error's HTTP status.

Every refusal is answered before a stream opens, as ``application/json``::

    {"error": {"type": "<ErrorType value>", "message": "<for a person>"}}

After a stream has opened, the same inner object is the data of an SSE ``error`` event.
No other module chooses a status code: routes and the runtime raise ``ApiError`` or let
an exception through, and ``error_handlers.api_error_for`` turns any exception into one.
This module imports no web framework (``app.runtime`` raises its errors);
``error_handlers.py`` answers them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from streams import ErrorType  # one enum for the envelope and the stream's error event

STATUS: dict[ErrorType, int] = {
    ErrorType.UNAUTHORIZED: 401,
    ErrorType.INVALID_JSON: 422,
    ErrorType.INVALID_REQUEST: 422,
    ErrorType.INVALID_CONSTRAINT: 422,
    ErrorType.PROMPT_TOO_LONG: 422,
    ErrorType.BODY_TOO_LARGE: 413,
    ErrorType.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorType.NOT_FOUND: 404,
    ErrorType.MODEL_NOT_FOUND: 404,
    ErrorType.METHOD_NOT_ALLOWED: 405,
    ErrorType.REQUEST_TIMEOUT: 408,
    ErrorType.BAD_REQUEST: 400,
    ErrorType.TOO_MANY_WAITING: 429,
    ErrorType.TOO_MANY_STREAMS: 429,
    ErrorType.TOO_MANY_DETACHED: 429,
    ErrorType.KEY_LIMIT: 429,
    ErrorType.TOO_MANY_WATCHERS: 429,
    ErrorType.TOO_MANY_STORED: 429,
    ErrorType.DEADLINE_UNMEETABLE: 429,
    ErrorType.DEADLINE_MISSED: 503,  # a whole answer's status; a stream's SSE error
    ErrorType.NOT_READY: 503,
    ErrorType.SHUTDOWN: 503,
    ErrorType.UNAVAILABLE: 503,
    ErrorType.SLOW_CLIENT: 503,
    ErrorType.ENGINE_ERROR: 500,
    ErrorType.STREAM_BUSY: 409,
    ErrorType.TAKEN_OVER: 409,
    ErrorType.RESUME_LOG_FULL: 503,
    ErrorType.INTERNAL_ERROR: 500,
}


class ApiError(Exception):
    """One error answer: its type (which fixes the status), message and extra headers.

    Args:
        type: what went wrong; ``STATUS[type]`` is the status code.
        message: for a person.
        retry_after_s: sent as ``Retry-After`` (whole seconds, rounded up).
        allow: the methods a 405 sends in ``Allow``.
        detail: more fields of the error object, after ``type`` and ``message``
            (none today).
    """

    def __init__(
        self,
        type: ErrorType,
        message: str,
        *,
        retry_after_s: float | None = None,
        allow: tuple[str, ...] = (),
        detail: Mapping[str, object] | None = None,
    ) -> None:
        super().__init__(f"{type}: {message}")
        self.type = type
        self.message = message
        self.retry_after_s = retry_after_s
        self.allow = allow
        self.detail = dict(detail or {})

    @property
    def status(self) -> int:
        return STATUS[self.type]

    def envelope(self) -> dict[str, dict[str, object]]:
        return {"error": {"type": self.type.value, "message": self.message, **self.detail}}

    def headers(self) -> dict[str, str]:
        """The headers its answer carries besides the content type."""
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
        if self.allow:
            headers["Allow"] = ", ".join(self.allow)
        if self.type is ErrorType.UNAUTHORIZED:  # RFC 6750 section 3
            headers["WWW-Authenticate"] = 'Bearer realm="streamscope"'
        return headers
