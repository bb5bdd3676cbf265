"""Resumable streams over HTTP (opt-in): ids that name the stream, a resume route, DELETE.

The wire contract (a browser page builds on it; keep it exactly):

* ``POST /v1/stream`` with ``"resumable": true``: the usual SSE events, but every id is
  ``<request_id>:<n>`` (n counts events from 1, as on a plain stream), and the response
  says where to resume in ``X-Resume-URL: /v1/stream/<request_id>``. Without
  ``resumable`` nothing changes.
* ``POST /v1/requests``, the same body: the request is created with no reader and
  answered 201 ``{"id", "stream_url"}`` with ``Location``; refusals as for
  ``/v1/stream``. A reader must attach within ``attach_timeout_s`` (then the grace
  period as usual), or the stream is cancelled. With a shared store the 201 waits until
  the stream is in it (any replica then finds it; 503 ``unavailable`` if it does not
  answer). With an API key set, ``stream_url``
  carries the stream's read token (``?token=<expiry>.<mac>``, ``auth.stream_query``),
  which opens its ``GET`` without the key (EventSource sends no headers) until it
  expires. Either way of making a resumable stream is refused with 429
  ``too_many_detached`` while ``max_detached_streams`` generate with no reader; with
  API keys, the stream's id is its key's, and another key's ``GET`` or ``DELETE`` of it
  is 404 ``not_found`` (``auth.check_owner``).
* ``GET /v1/stream/<request_id>`` with ``Last-Event-ID: <request_id>:<n>`` (or
  ``?last_event_id=``; the header wins; none means from the start): the events after n
  from the log, then live, each exactly once; the first line is ``retry: 1000`` (once).
  204 for a stream unknown or expired, or ended with n its last event (EventSource stops
  reconnecting on a 204). 400 ``bad_request`` for an id of another stream; 422
  ``invalid_request`` for a malformed one or an n the stream has not reached; 503
  ``unavailable`` (Retry-After) when the stream is another replica's and the shared log
  does not answer, or (503 ``shutdown``) when it is another replica's and this one is
  draining. One reader at a time, the newest: a GET while another reader holds
  the stream takes it over (the server cannot tell a silently dead connection from a
  live one); the old reader gets no more events, and its body ends with one ``error``
  event ``taken_over`` without an id (not part of the stream: an EventSource keeps its
  Last-Event-ID, and a page that sees it stops instead of taking the stream back). 409
  ``stream_busy`` only if the old reader did not let go within a bound (try again).
* ``DELETE /v1/requests/<request_id>``: ends a resumable stream at once (the engine is
  asked to cancel it; its log is dropped): 204, or 404 ``not_found``. With a shared
  store, on any replica: one that does not generate the stream cancels it through the
  store (its owner ends it at its next lease renewal; 503 ``unavailable`` if the store
  does not answer).

Ownership: the stream belongs to the resume registry from the moment it opens
(``registry_owned.open_registry_owned``, right after ``Runtime.open``, no checkpoint
between); both ways of making one run the one pipeline (``pipeline.py``); a response's
connection owns its ``Reader``, whose ``close()`` hands the stream back to the registry
when the response ends, however it ends. ``streams.resume`` tells the hand-over and what
happens when nobody comes back. With ``STREAMSCOPE_RESUME_STORE=redis://...`` the GET works on
any replica: one that does not own the stream serves the shared log (a
``RemoteReader``). Keep-alive comments as on any stream (the one body, ``body.py``, with
``resume_source.ResumeSource``); no lab padding.
"""

from __future__ import annotations

from quart import Blueprint, Response, request

from streams.resume import (
    BadPosition,
    Draining,
    NothingToResume,
    ReaderBusy,
    StoreUnavailable,
)

from ..auth import check_owner, stream_query
from ..edge.connection import close_with_connection
from ..errors import ApiError, ErrorType
from ..metrics import Metrics
from ..runtime import SHUTDOWN_RETRY_AFTER_S, Runtime
from ..schemas import GenerateBody
from ..wire import RETRY_MS
from .body import EventStreamBody
from .native import NativeAdapter
from .pipeline import Call, Pipeline
from .registry_owned import open_registry_owned, resume_url, wait_stored
from .resume_source import LoggedEvents, ResumeSource
from .serving import json_response, sse_response

# n in an event id has at most this many digits: far more events than max_new_tokens allows.
MAX_POSITION_DIGITS = 9


class RequestsAdapter(NativeAdapter):
    """``POST /v1/requests``: the native body, always registry-owned, answered 201."""

    def __init__(self) -> None:
        super().__init__(streaming=True)

    def registry_owned(self, body: GenerateBody) -> bool:
        return True

    async def answer(self, call: Call[GenerateBody]) -> Response:
        return await create_request(call)


async def create_request(call: Call[GenerateBody]) -> Response:
    """``POST /v1/requests``: open a resumable stream with no reader; 201 with where to
    read it.

    Cancellation: before the stream opens, nothing to undo; after, the registry owns it
    (while the 201 waits for a shared store, its grace period runs).
    """
    runtime = call.runtime
    stream, _ = open_registry_owned(runtime, call.prepared, call.spec, call.timer,
                                    attach=False,
                                    attach_within_s=runtime.settings.attach_timeout_s)
    await wait_stored(runtime, stream.request_id)
    url = resume_url(stream.request_id) + stream_query(stream.request_id)
    return json_response({"id": stream.request_id, "stream_url": url}, status=201,
                         headers={"Location": url, "X-Request-ID": stream.request_id})


def parse_position(value: str | None, request_id: str) -> int:
    """The n of a ``Last-Event-ID`` (``<request_id>:<n>``); 0 for none.

    Raises: ApiError 400 (another stream's id), 422 (malformed).
    """
    if not value:
        return 0
    stream_id, colon, n = value.rpartition(":")
    if not colon or not (n.isascii() and n.isdigit()) or len(n) > MAX_POSITION_DIGITS:
        raise ApiError(ErrorType.INVALID_REQUEST,
                       "Last-Event-ID must be <request_id>:<n>, as the events' ids are")
    if stream_id != request_id:
        raise ApiError(ErrorType.BAD_REQUEST, "Last-Event-ID names another stream")
    return int(n)


class ResumableViews:
    """The views, bound to one app's runtime; each request reports to ``metrics``."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    async def resume(self, request_id: str) -> Response:
        """Replay after Last-Event-ID, then follow live (see the module docstring).

        Cancellation: handed over: the stream is the registry's throughout. While
        attaching, the wait for the holder is finished first (shielded, one scheduling
        round); after, the connection owns the reader, whose close hands the stream back.
        """
        check_owner(request_id)  # another API key's stream: 404, as if absent
        registry = self.runtime.resume_registry()
        last = request.headers.get("Last-Event-ID") or request.args.get("last_event_id")
        after = parse_position(last, request_id)
        try:
            reader = await registry.attach(request_id, after)
        except NothingToResume:
            return Response(b"", status=204)
        except ReaderBusy:
            raise ApiError(ErrorType.STREAM_BUSY,
                           "the stream's previous reader did not let go in time; "
                           "try again") from None
        except BadPosition as exc:
            raise ApiError(ErrorType.INVALID_REQUEST, str(exc)) from None
        except StoreUnavailable:
            raise ApiError(ErrorType.UNAVAILABLE, "the shared stream log does not answer; "
                           "try again", retry_after_s=RETRY_MS / 1000) from None
        except Draining:
            raise ApiError(ErrorType.SHUTDOWN, "this replica is stopping: resume the stream "
                           "on another", retry_after_s=SHUTDOWN_RETRY_AFTER_S) from None
        close_with_connection(request.scope, reader)
        body = EventStreamBody(ResumeSource(reader, registry), LoggedEvents(send_retry=True),
                               keepalive_s=self.runtime.settings.keepalive_s)
        return sse_response(body, request_id, headers={"X-Resume-URL": resume_url(request_id)})

    async def cancel_request(self, request_id: str) -> Response:
        """End a resumable stream now, on this replica or (with a shared store) on the
        one that generates it: 204, 404, or 503 if that store does not answer.
        Cancellation: abandoned at the ask of the store only (one atomic script: it
        lands whole or not; asked again, idempotent); a local stream is closed before any
        checkpoint."""
        check_owner(request_id)  # another API key's stream: 404, as if absent
        try:
            cancelled = await self.runtime.resume_registry().cancel_anywhere(request_id)
        except StoreUnavailable:
            raise ApiError(ErrorType.UNAVAILABLE, "the shared stream log does not answer; "
                           "try again", retry_after_s=RETRY_MS / 1000) from None
        if not cancelled:
            raise ApiError(ErrorType.NOT_FOUND,
                           f"no resumable request {request_id[:64]!r}: unknown or over")
        return Response(b"", status=204)


def make_resumable_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """``POST /v1/requests``, ``GET /v1/stream/<id>``, ``DELETE /v1/requests/<id>``."""
    bp = Blueprint("resumable", __name__)
    views = ResumableViews(runtime)
    bp.add_url_rule("/v1/requests", "create_request",
                    Pipeline(runtime, metrics).view(RequestsAdapter()), methods=["POST"])
    bp.add_url_rule("/v1/stream/<request_id>", view_func=views.resume, methods=["GET"])
    bp.add_url_rule("/v1/requests/<request_id>", view_func=views.cancel_request,
                    methods=["DELETE"])
    return bp
