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
(``adopt``, right after ``Runtime.open``, no checkpoint between); a response's
connection owns its ``Reader``, whose ``close()`` hands the stream back to the registry
when the response ends, however it ends. ``streams.resume`` tells the hand-over and what
happens when nobody comes back. With ``STREAMSCOPE_RESUME_STORE=redis://...`` the GET works on
any replica: one that does not own the stream serves the shared log (a
``RemoteReader``). Keep-alive comments as on any stream (the one body, ``body.py``, with
``resume_source.ResumeSource``); no lab padding.
"""

from __future__ import annotations

import trio
from quart import Blueprint, Response, request

from engine import GenerationRequest
from streams import PolicyName, TokenStream
from streams.resume import (
    BadPosition,
    Draining,
    NothingToResume,
    Reader,
    ReaderBusy,
    ResumeRegistry,
    StoreUnavailable,
    spec_of,
    with_seed,
)

from ..auth import check_owner, observer, owned_request, stream_query
from ..edge.connection import close_with_connection
from ..errors import ApiError, ErrorType
from ..metrics import Metrics, RequestTimer
from ..runtime import SHUTDOWN_RETRY_AFTER_S, Prepared, Runtime
from ..schemas import RequestLimits, parse_generate_body
from ..wire import RETRY_MS, ResumableEvents
from .body import EventStreamBody
from .resume_source import LoggedEvents, ResumeSource
from .serving import json_response, read_body, sse_response, ttft_deadline

# n in an event id has at most this many digits: far more events than max_new_tokens allows.
MAX_POSITION_DIGITS = 9
# With a shared store, how long ``POST /v1/requests`` waits for the new stream to be in
# it before its 201 (a write takes milliseconds; a store away that long: 503).
STORED_WAIT_S = 2.0


def resume_url(request_id: str) -> str:
    return f"/v1/stream/{request_id}"


def adopt(registry: ResumeRegistry, stream: TokenStream, timer: RequestTimer, *,
          attach: bool, spec: bytes | None, attach_within_s: float | None = None,
          ) -> Reader | None:
    """The registry takes a stream just opened (``Runtime.open``), and its timer (closed
    when the registry forgets the stream) with the request's slot of its API key
    (``auth.observer``); with ``attach``, the request's connection owns its first
    reader, else a reader must come within ``attach_within_s``. Sync, never a
    checkpoint: call it right after the open."""
    timer.submitted(stream.prompt_tokens, stream.request_id)
    events = ResumableEvents(stream.request_id, stream.prompt_tokens)
    watcher = observer(timer)
    try:
        reader = registry.adopt(stream, events, events.opening(), observer=watcher,
                                attach=attach, spec=spec, attach_within_s=attach_within_s)
    except RuntimeError:  # not running (the stream is closed): nobody else closes watcher
        watcher.close()
        raise
    if reader is not None:
        close_with_connection(request.scope, reader)
    return reader


async def open_resumable(
    runtime: Runtime,
    generation: GenerationRequest,
    policy: PolicyName | None,
    timer: RequestTimer,
) -> Response:
    """``POST /v1/stream`` with ``resumable``: open the stream in the registry and answer
    it with its first reader.

    Cancellation: before the stream opens, nothing to undo; after, the connection owns
    the reader and the registry the stream.
    """
    prepared, spec = await _prepare(runtime, owned_request(generation), policy)
    registry = runtime.resume_registry()
    check_detached(runtime, registry)
    stream = runtime.open(prepared, resumable=True)
    reader = adopt(registry, stream, timer, attach=True, spec=spec)
    assert reader is not None  # attach=True
    body = EventStreamBody(ResumeSource(reader), LoggedEvents(send_retry=False),
                           keepalive_s=runtime.settings.keepalive_s)
    return sse_response(body, stream.request_id,
                        headers={"X-Resume-URL": resume_url(stream.request_id)})


async def _prepare(
    runtime: Runtime, generation: GenerationRequest, policy: PolicyName | None
) -> tuple[Prepared, bytes | None]:
    """The request prepared (``Runtime.prepare``) and, with a shared store, seeded, with
    its failover spec (``streams.resume.spec_of``); else None for the spec.
    Cancellation: nothing opened yet."""
    if runtime.settings.resume_store is None:
        return await runtime.prepare(generation, policy), None
    prepared = await runtime.prepare(with_seed(generation), policy)
    return prepared, spec_of(prepared.request, policy)


def check_detached(runtime: Runtime, registry: ResumeRegistry) -> None:
    """Refuse a new resumable stream while ``max_detached_streams`` generate with no
    reader (each may become one). Sync: call it right before the open.

    Raises: ApiError 429 too_many_detached (``Retry-After``: the attach timeout, within
    which a created stream nobody reads ends).
    """
    settings = runtime.settings
    if registry.generating_detached() >= settings.max_detached_streams:
        raise ApiError(ErrorType.TOO_MANY_DETACHED,
                       f"{settings.max_detached_streams} resumable streams generate with no "
                       f"reader, this server's limit; try again later",
                       retry_after_s=settings.attach_timeout_s)


async def _wait_stored(runtime: Runtime, request_id: str) -> None:
    """With a shared store, return once the stream just opened is in it (spec, owner
    lease, event 1), so that a resume on any replica finds it: a 201 promises that (a
    replica that does not know the stream answers 204, and an EventSource stops). A
    store that does not take it within ``STORED_WAIT_S``: the stream is cancelled and
    the request refused with 503 ``unavailable`` (``Retry-After``), as a resume of
    another replica's stream is then. Without a shared store, at once.

    Raises: ApiError 503. Cancellation: the registry holds the stream (its grace period
    runs), as when a client leaves right after its 201.
    """
    registry = runtime.resume_registry()
    with trio.move_on_after(STORED_WAIT_S):
        try:
            await registry.stored()
            return
        except StoreUnavailable:
            pass
    registry.cancel(request_id)
    raise ApiError(ErrorType.UNAVAILABLE, "the shared stream log does not answer; try again",
                   retry_after_s=RETRY_MS / 1000)


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

    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.limits = RequestLimits.from_settings(runtime.settings)

    async def create_request(self) -> Response:
        """Open a resumable stream with no reader; 201 with where to read it.

        Cancellation: before the stream opens, nothing to undo; after, the registry
        owns it (while the 201 waits for a shared store, its grace period runs).
        """
        settings = self.runtime.settings
        timer = self.metrics.start_request()
        body = parse_generate_body(await read_body(), self.limits)
        deadline = ttft_deadline(timer, body.deadline_ms, settings.ttft_deadline_ms)
        generation = owned_request(body.to_generation_request(deadline))
        prepared, spec = await _prepare(self.runtime, generation, body.policy)
        registry = self.runtime.resume_registry()
        check_detached(self.runtime, registry)
        stream = self.runtime.open(prepared, resumable=True)
        adopt(registry, stream, timer, attach=False, spec=spec,
              attach_within_s=settings.attach_timeout_s)
        await _wait_stored(self.runtime, stream.request_id)
        url = resume_url(stream.request_id) + stream_query(stream.request_id)
        return json_response({"id": stream.request_id, "stream_url": url}, status=201,
                             headers={"Location": url, "X-Request-ID": stream.request_id})

    async def resume(self, request_id: str) -> Response:
        """Replay after Last-Event-ID, then follow live (see the module docstring).

        Cancellation: while attaching, nothing changes (the wait for the holder is
        shielded); after, the connection owns the reader.
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
        Cancellation: at the ask of the store only (it lands or not)."""
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
    views = ResumableViews(runtime, metrics)
    bp.add_url_rule("/v1/requests", view_func=views.create_request, methods=["POST"])
    bp.add_url_rule("/v1/stream/<request_id>", view_func=views.resume, methods=["GET"])
    bp.add_url_rule("/v1/requests/<request_id>", view_func=views.cancel_request,
                    methods=["DELETE"])
    return bp
