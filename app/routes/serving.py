"""What every route does to serve a request, in one place each.

* ``read_body``: the request body, read once (at most ``MAX_BODY_BYTES``), refused
  unless its ``Content-Type`` is ``application/json`` (415); the only place a view
  reads a body.
* ``submitted``: a stream just opened (``Runtime.open``) and owned by the request's
  connection (``app.edge.connection``, its closer; ``docs/cancellation.md`` tells the
  disconnect path) starts its metrics timer, which the connection closes too.
* ``open_choices``: the same for the several streams of one request (OpenAI's ``n``).
* ``ttft_deadline``: when a request's first token is due.
* ``sse_response``: every ``text/event-stream`` answer, with its headers and no
  response timeout.
* ``collect`` and ``json_response``: a whole answer.

Knows Quart's request context; knows no route.
"""

from __future__ import annotations

import json
from typing import Any

from quart import Response, request
from quart.wrappers.response import ResponseBody

from engine import FinishEvent, TokenEvent
from streams import StreamError, TokenStream

from ..edge.connection import close_with_connection
from ..errors import ApiError, ErrorType
from ..metrics import RequestTimer
from ..runtime import Prepared, Runtime

JSON_MEDIA_TYPE = "application/json"  # what every body must be sent as
SSE_CONTENT_TYPE = "text/event-stream; charset=utf-8"
SSE_HEADERS = {
    "Cache-Control": "no-cache",  # no cache may hold an event back
    "X-Accel-Buffering": "no",  # nor a buffering proxy (nginx honours this header)
}


async def read_body() -> bytes:
    """The request's body, at most MAX_BODY_BYTES (Quart's MAX_CONTENT_LENGTH), if its
    ``Content-Type`` says JSON (``require_json``).

    The body is read first, refused or not: a response that went out before its request
    body arrived would leave the connection to a race (``app/edge/request_drain.py``), and a
    malformed chunked body, left unread, would get no answer at all.

    Raises: RequestEntityTooLarge (413); ApiError unsupported_media_type (415).
    Cancellation: nothing to undo: it lands while the body arrives, before anything
    is opened or submitted.
    """
    body = await request.get_data(cache=False, as_text=False, parse_form_data=False)
    require_json()
    return body


def require_json() -> None:
    """Refuse a body whose ``Content-Type`` is not ``application/json`` (parameters such
    as ``charset`` allowed).

    The types a browser may send to another origin without asking it first (a "simple"
    request: ``text/plain``, a form) are refused so: a page on any site cannot make a
    browser on this machine post to a server that has no API key. Sync, no checkpoint.

    Raises: ApiError unsupported_media_type (415).
    """
    if request.mimetype != JSON_MEDIA_TYPE:
        sent = request.headers.get("Content-Type")
        shown = "no Content-Type" if sent is None else f"Content-Type {sent[:80]!r}"
        raise ApiError(ErrorType.UNSUPPORTED_MEDIA_TYPE,
                       f"the body must be JSON, sent with Content-Type: {JSON_MEDIA_TYPE} "
                       f"(this request has {shown})")


def ttft_deadline(
    timer: RequestTimer, deadline_ms: float | None, default_ms: float | None
) -> float | None:
    """When the request's first token is due, in ``time.monotonic()`` seconds: its
    ``deadline_ms`` (else the server's ``STREAMSCOPE_TTFT_DEADLINE_MS``) after its
    arrival (the timer's start, when its head arrived), or None for no deadline.

    The hub refuses it (429 ``deadline_unmeetable``, before any byte) if the engine's
    estimate is later; once its stream has opened (``start`` sent), a deadline that
    passes before its prefill began ends it with an ``error`` event ``deadline_missed``
    (a whole answer: a 503 with that type).
    """
    chosen = default_ms if deadline_ms is None else deadline_ms
    return None if chosen is None else timer.arrival + chosen / 1000


def open_owned(runtime: Runtime, prepared: Prepared, timer: RequestTimer) -> TokenStream:
    """Open a prepared request and give its stream and timer to the connection: the one
    way every route's request reaches the hub. The connection closes both however the
    request ends (the stream asks the engine to cancel; the timer records ``cancelled``
    unless the stream ended).

    Sync, never a checkpoint: nothing can cancel between the open and the owning.

    Raises: what ``Runtime.open`` raises; nothing was submitted then.
    """
    stream = runtime.open(prepared)
    close_with_connection(request.scope, stream)
    timer.submitted(stream.prompt_tokens, stream.request_id, prepared.request.max_new_tokens)
    close_with_connection(request.scope, timer)
    return stream


def open_choices(runtime: Runtime, prepared: list[Prepared], timer: RequestTimer
                 ) -> list[TokenStream]:
    """``open_owned`` for the choices of one request (``choices.py``): each stream given
    to the connection as it opens, the timer once. Sync, never a checkpoint.

    Raises: what ``Runtime.open`` raises; the streams opened before are the connection's,
    which closes them."""
    streams = []
    for one in prepared:
        stream = runtime.open(one)
        close_with_connection(request.scope, stream)
        streams.append(stream)
    timer.submitted(streams[0].prompt_tokens)
    close_with_connection(request.scope, timer)
    return streams


def sse_response(
    body: ResponseBody, request_id: str | None, *, headers: dict[str, str] | None = None
) -> Response:
    """A ``text/event-stream`` response around ``body``, which owns what it reads.

    No response timeout: Quart's RESPONSE_TIMEOUT (60 s) would cut the stream; the
    stream's own limits (max_new_tokens, the drain deadline) bound it.
    """
    all_headers = dict(SSE_HEADERS)
    if request_id is not None:
        all_headers["X-Request-ID"] = request_id
    all_headers.update(headers or {})
    response = Response(body, status=200, content_type=SSE_CONTENT_TYPE, headers=all_headers)
    response.timeout = None
    return response


async def collect(
    stream: TokenStream, timer: RequestTimer
) -> tuple[str, list[TokenEvent], FinishEvent]:
    """Read a stream to its end: (text, token events, finish), or ApiError for a
    StreamError.

    Cancellation: nothing to undo: it lands at ``stream.receive()``, which takes no
    item it does not return; the stream is closed by its owner (the caller's ``with``).
    """
    text: list[str] = []
    tokens: list[TokenEvent] = []
    async for item in stream:
        timer.observe(item)
        match item:
            case TokenEvent():
                text.append(item.text)
                tokens.append(item)
            case FinishEvent():
                return "".join(text), tokens, item
            case StreamError():
                raise ApiError(item.type, item.message)
    raise ApiError(ErrorType.INTERNAL_ERROR, "the stream ended without a result")


def json_response(
    data: dict[str, Any], *, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """One JSON document."""
    return Response(json.dumps(data), status=status, content_type="application/json",
                    headers=headers)
