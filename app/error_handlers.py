"""What answers each exception: the error envelope as Quart's response.

``errors.py`` says what each error type's status and headers are and imports no web
framework; this module chooses the ``ApiError`` that answers an exception
(``api_error_for``), writes it out (``error_response``), and registers the app's handler.

    Exception                      ->  ErrorType            status
    ├── ApiError                   ->  its own type (unauthorized 401 + WWW-Authenticate)
    ├── pydantic.ValidationError   ->  invalid_json          422  (body is not JSON)
    │                                  invalid_request       422  (wrong, unknown, out-of-range)
    ├── engine.InvalidRequest
    │   ├── PromptTooLong          ->  prompt_too_long       422
    │   ├── InvalidConstraint      ->  invalid_constraint    422
    │   └── (the others)           ->  invalid_request       422
    ├── streams.HubError
    │   ├── WaitingLimitReached    ->  too_many_waiting      429  + Retry-After
    │   ├── DeadlineUnmeetable     ->  deadline_unmeetable   429  + Retry-After (coarse)
    │   └── NotAccepting           ->  not_ready | shutdown | unavailable   503
    ├── werkzeug HTTPException     ->  not_found 404, method_not_allowed 405 (+ Allow),
    │                                  request_timeout 408, body_too_large 413, else bad_request
    └── anything else              ->  internal_error        500  (logged with its traceback)

A blueprint whose routes answer in another protocol's shape (``routes/anthropic.py``)
says so with ``answer_errors_under``: the errors of every request under its path prefix
that reach the app's handler (a 405 for a method it lacks, a 404 for an unknown path
below it, a 401 for one: none of them ever reaches the blueprint's own handler, since no
route of it matched) are then answered in that shape too.

``trio.Cancelled`` is a BaseException: no handler here ever sees it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable

import pydantic
from quart import Quart, Response, request
from werkzeug.exceptions import HTTPException, InternalServerError, MethodNotAllowed

import engine
import streams

from .errors import ApiError, ErrorType

log = logging.getLogger("streamscope.app")

# A validation message names at most this many problems: enough to fix a request,
# short enough that an adversarial body cannot make the answer large.
MAX_PROBLEMS_SHOWN = 5
_INTERNAL_MESSAGE = "the server failed to answer this request"

_HTTP_TYPES = {
    404: ErrorType.NOT_FOUND,
    405: ErrorType.METHOD_NOT_ALLOWED,
    408: ErrorType.REQUEST_TIMEOUT,
    413: ErrorType.BODY_TOO_LARGE,
}

_PATH_ERRORS = "streamscope_path_errors"  # app.extensions: [(prefix, error_for)]
ErrorFor = Callable[[BaseException], ApiError]

_NOT_ACCEPTING_TYPES = {
    streams.HubState.NEW.value: ErrorType.NOT_READY,
    streams.HubState.DRAINING.value: ErrorType.SHUTDOWN,
    streams.HubState.STOPPED.value: ErrorType.SHUTDOWN,
    streams.HubState.FAILED.value: ErrorType.UNAVAILABLE,
}


def api_error_for(exc: BaseException) -> ApiError:
    """The ApiError that answers ``exc`` (see the module docstring's table)."""
    match exc:
        case ApiError():
            return exc
        case pydantic.ValidationError():
            return _validation_error(exc)
        case engine.PromptTooLong():
            return ApiError(ErrorType.PROMPT_TOO_LONG, str(exc))
        case engine.InvalidConstraint():
            return ApiError(ErrorType.INVALID_CONSTRAINT, str(exc))
        case engine.InvalidRequest():
            return ApiError(ErrorType.INVALID_REQUEST, str(exc))
        case streams.WaitingLimitReached():
            return ApiError(ErrorType.TOO_MANY_WAITING, str(exc), retry_after_s=exc.retry_after_s)
        case streams.DeadlineUnmeetable():
            # No estimate: it would tell a cached prompt from a fresh one (docs/security.md).
            return ApiError(ErrorType.DEADLINE_UNMEETABLE, str(exc),
                            retry_after_s=exc.retry_after_s)
        case streams.NotAccepting():
            kind = _NOT_ACCEPTING_TYPES.get(exc.state, ErrorType.UNAVAILABLE)
            return ApiError(kind, str(exc))
        case InternalServerError():  # Quart wraps an unhandled exception; it logged it
            return ApiError(ErrorType.INTERNAL_ERROR, _INTERNAL_MESSAGE)
        case HTTPException() if exc.code is not None and exc.code < 500:
            kind = _HTTP_TYPES.get(exc.code, ErrorType.BAD_REQUEST)
            allow = tuple(exc.valid_methods or ()) if isinstance(exc, MethodNotAllowed) else ()
            return ApiError(kind, exc.description or kind.value, allow=allow)
        case _:
            log.error("internal error", exc_info=(type(exc), exc, exc.__traceback__))
            return ApiError(ErrorType.INTERNAL_ERROR, _INTERNAL_MESSAGE)


def error_response(error: ApiError) -> Response:
    """``error`` as ``application/json`` with its status and headers."""
    response = Response(json.dumps(error.envelope()), status=error.status,
                        content_type="application/json")
    response.headers.update(error.headers())
    return response


def register_error_handlers(
    app: Quart, on_refusal: Callable[[ApiError], None] | None = None
) -> None:
    """Answer every Exception (HTTPExceptions included) with the envelope.

    Quart looks handlers up along the exception's MRO, so the one for ``Exception`` also
    gets 404, 405 and 413 and the InternalServerError wrapping an unhandled exception.
    ``trio.Cancelled`` is not an Exception and passes by untouched. ``on_refusal`` is
    told of every answer (the metrics count them by status).
    """

    async def handle(exc: Exception) -> Response:
        """Cancellation: nothing to undo, as none can land: no checkpoint."""
        error = _error_for_path(app, request.path)(exc)
        if on_refusal is not None:
            on_refusal(error)
        return error_response(error)

    app.register_error_handler(Exception, handle)


def answer_errors_under(app: Quart, prefix: str, error_for: ErrorFor) -> None:
    """Answer the errors of ``prefix`` and every path below it with ``error_for``
    instead of ``api_error_for``, in the app's own handler (see the module docstring)."""
    app.extensions.setdefault(_PATH_ERRORS, []).append((prefix.rstrip("/"), error_for))


def _error_for_path(app: Quart, path: str) -> ErrorFor:
    for prefix, error_for in app.extensions.get(_PATH_ERRORS, ()):
        if path == prefix or path.startswith(prefix + "/"):
            return error_for  # type: ignore[no-any-return]
    return api_error_for


def _validation_error(exc: pydantic.ValidationError) -> ApiError:
    problems = exc.errors(include_url=False, include_input=False)
    if any(p["type"] == "json_invalid" for p in problems):
        detail = problems[0]["msg"].removeprefix("Invalid JSON: ")
        return ApiError(ErrorType.INVALID_JSON, f"the body is not valid JSON: {detail}")
    parts = []
    for problem in problems[:MAX_PROBLEMS_SHOWN]:
        where = ".".join(str(part) for part in problem["loc"]) or "body"
        parts.append(f"{where}: {problem['msg']}")
    if len(problems) > MAX_PROBLEMS_SHOWN:
        parts.append(f"and {len(problems) - MAX_PROBLEMS_SHOWN} more")
    return ApiError(ErrorType.INVALID_REQUEST, "; ".join(parts))
