"""Resumable streams over HTTP (opt-in): ids that name the stream, a resume route, DELETE.

The wire contract (a browser page builds on it; keep it exactly):

* ``POST /v1/stream`` with ``"resumable": true``: the usual SSE events, but every id is
  ``<request_id>:<n>`` (n counts events from 1, as on a plain stream), and the response
  says where to resume in ``X-Resume-URL: /v1/stream/<request_id>``. Without
  ``resumable`` nothing changes.
* ``POST /v1/requests``, the same body: the request is created with no reader (the grace
  period runs until one attaches) and answered 201 ``{"id", "stream_url"}`` with
  ``Location``; refusals as for ``/v1/stream``. With a shared store the 201 waits until
  the stream is in it (any replica then finds it; 503 ``unavailable`` if it does not
  answer). With an API key set, ``stream_url``
  carries the stream's read token (``?token=``, ``auth.stream_token``), which opens its
  ``GET`` without the key (EventSource sends no headers).
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
  asked to cancel it; its log is dropped): 204, or 404 ``not_found``.

Ownership: the stream belongs to the resumption registry from the moment it opens
(``ResumableOwner``, given to ``Runtime.open_stream``); a response's connection owns its
``Reader``, whose ``close()`` hands the stream back to the registry when the response
ends, however it ends. ``streams/resumption.py`` tells the hand-over and what happens
when nobody comes back. With ``STREAMSCOPE_RESUME_STORE=redis://...`` the GET works on
any replica: one that does not own the stream serves the shared log (a
``RemoteReader``). Keep-alive comments as on any stream; no lab padding.
"""

from __future__ import annotations

import json
from types import TracebackType

import trio
from quart import Blueprint, Response, request
from quart.wrappers.response import ResponseBody

from engine import GenerationRequest
from streams import (
    BadPosition,
    Draining,
    NothingToResume,
    OwnerGone,
    PolicyName,
    Reader,
    ReaderBusy,
    RemoteReader,
    ResumeRegistry,
    StoreUnavailable,
    StreamItem,
    TakenOver,
    TokenStream,
    encode_event,
)

from .auth import STREAM_TOKEN_PARAM, stream_token
from .connection import own_stream
from .errors import ApiError, ErrorType
from .failover import Rebuilder, spec_of, with_seed
from .lifespan import SHUTDOWN_RETRY_AFTER_S, Runtime
from .metrics import Metrics, RequestTimer
from .schemas import RequestLimits, parse_generate_body
from .serving import json_response, read_body, sse_response, ttft_deadline
from .sse_body import (
    KEEPALIVE_COMMENT,
    encode_json_event,
    error_data,
    item_event,
    start_event,
)

# How soon an EventSource reconnects after its connection dropped (the ``retry`` field,
# in ms): well within the grace period, and not a tight loop against a server that
# is briefly away.
RETRY_MS = 1000
RETRY_LINE = f"retry: {RETRY_MS}\n".encode()  # a field line alone: applied, dispatches nothing
# The old reader's last event when a newer one took its stream over: no id (it is not
# part of the stream), so an EventSource keeps its Last-Event-ID.
TAKEN_OVER_EVENT = encode_event(
    json.dumps(error_data(ErrorType.TAKEN_OVER, "another reader took this stream over"),
               separators=(",", ":")),
    event="error",
)
# n in an event id has at most this many digits: far more events than max_new_tokens allows.
MAX_POSITION_DIGITS = 9
# With a shared store, how long ``POST /v1/requests`` waits for the new stream to be in
# it before its 201 (a write takes milliseconds; a store away that long: 503).
STORED_WAIT_S = 2.0


def resume_url(request_id: str) -> str:
    return f"/v1/stream/{request_id}"


class ResumableEncoder:
    """One stream's events as ``/v1/stream`` writes them, with ids ``<request_id>:<n>``."""

    def __init__(self, request_id: str, prompt_tokens: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens

    def opening(self) -> bytes:
        """Event 1, ``start``."""
        return encode_json_event(
            *_named(start_event(self.request_id, self.prompt_tokens), self._id(1))
        )

    def __call__(self, n: int, item: StreamItem) -> bytes:
        return encode_json_event(*_named(item_event(item), self._id(n)))

    def _id(self, n: int) -> str:
        return f"{self.request_id}:{n}"


def _named(
    event: tuple[str, dict[str, object]], event_id: str
) -> tuple[str, str, dict[str, object]]:
    return event[0], event_id, event[1]


class ResumableOwner:
    """The resumption registry as the owner of a stream opening now (``StreamHolder``);
    with ``attach``, the request's connection owns the first ``reader``."""

    def __init__(self, registry: ResumeRegistry, timer: RequestTimer, *, attach: bool,
                 spec: bytes | None = None) -> None:
        self._registry = registry
        self._timer = timer
        self._attach = attach
        self._spec = spec  # what a failover needs (app/failover.py), with a shared store
        self.reader: Reader | None = None

    def own(self, stream: TokenStream) -> None:
        """Sync, never a checkpoint: the registry adopts the stream, and the timer (closed
        when the registry forgets the stream), before anything can interrupt."""
        self._timer.submitted(stream.prompt_tokens)
        encoder = ResumableEncoder(stream.request_id, stream.prompt_tokens)
        self.reader = self._registry.adopt(
            stream, encoder, encoder.opening(), observer=self._timer, attach=self._attach,
            spec=self._spec,
        )
        if self.reader is not None:
            own_stream(request.scope, self.reader)


class ResumableEventBody(ResponseBody):
    """The SSE body of one reader of a resumable stream: the log after its position,
    then live events; keep-alive comments in between; ``TAKEN_OVER_EVENT`` last if a
    newer reader took the stream over. ``__aexit__`` lets the reader go. A remote reader
    whose owner died (``OwnerGone``) is replaced in place by ``registry.attach`` at its
    position, which takes the stream over (failover): the client reads on, unaware.
    """

    def __init__(
        self, reader: Reader | RemoteReader, *, keepalive_s: float, send_retry: bool,
        registry: ResumeRegistry | None = None,
    ) -> None:
        self.reader = reader
        self.keepalive_s = keepalive_s
        self._retry = send_retry
        self._registry = registry
        self._over = False

    async def __aenter__(self) -> ResumableEventBody:
        """Cancellation: no checkpoint."""
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Hand the stream back to the registry. Cancellation: no checkpoint."""
        self.reader.close()

    def __aiter__(self) -> ResumableEventBody:
        return self

    async def __anext__(self) -> bytes:
        """The next event's bytes (the ``retry`` line first, if asked), or a keep-alive.

        Cancellation: at ``reader.receive()``, with nothing taken (it is cancel-safe).
        """
        if self._over:
            raise StopAsyncIteration
        if self._retry:
            self._retry = False
            return RETRY_LINE
        gone: OwnerGone | None = None
        with trio.move_on_after(self.keepalive_s):
            try:
                event = await self.reader.receive()
            except TakenOver:
                self._over = True
                return TAKEN_OVER_EVENT
            except OwnerGone as exc:
                gone = exc
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise StopAsyncIteration from None
            else:
                return event.data
        if gone is not None:  # out of the keep-alive's scope: its timer cancels nothing
            await self._take_over(gone.position)
        return KEEPALIVE_COMMENT

    async def _take_over(self, position: int) -> None:
        """Attach again after ``position`` (failover, or another remote reader if another
        replica took over first); the body ends (the client resumes) if that fails.

        Cancellation: as ``ResumeRegistry.attach``; the old reader is closed already.
        """
        self.reader.close()
        if self._registry is None:
            raise StopAsyncIteration
        try:
            self.reader = await self._registry.attach(self.reader.request_id, position)
        except Exception:  # any refusal: the client comes back (Cancelled passes)
            raise StopAsyncIteration from None


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
    generation, spec = await _with_spec(runtime, generation, policy)
    owner = ResumableOwner(runtime.resume_registry(), timer, attach=True, spec=spec)
    stream = await runtime.open_stream(generation, policy, owner=owner)
    assert owner.reader is not None  # attach=True
    body = ResumableEventBody(owner.reader, keepalive_s=runtime.settings.keepalive_s,
                              send_retry=False)
    return sse_response(body, stream.request_id,
                        headers={"X-Resume-URL": resume_url(stream.request_id)})


async def _with_spec(
    runtime: Runtime, generation: GenerationRequest, policy: PolicyName | None
) -> tuple[GenerationRequest, bytes | None]:
    """With a shared store: the request encoded and seeded, and its failover spec
    (``failover.py``); else as it is, and None. Cancellation: nothing opened yet."""
    if runtime.settings.resume_store is None:
        await trio.lowlevel.checkpoint()
        return generation, None
    generation = with_seed(await runtime.encoded(generation))
    return generation, spec_of(generation, policy)


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


def make_resumable_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """``POST /v1/requests``, ``GET /v1/stream/<id>``, ``DELETE /v1/requests/<id>``."""
    bp = Blueprint("resumable", __name__)
    settings = runtime.settings
    runtime.rebuild = Rebuilder(runtime, metrics)  # a dead replica's streams go on here
    limits = RequestLimits.from_settings(settings)

    @bp.post("/v1/requests")
    async def create_request() -> Response:
        """Open a resumable stream with no reader; 201 with where to read it.

        Cancellation: before the stream opens, nothing to undo; after, the registry
        owns it (no checkpoint follows).
        """
        timer = metrics.start_request()
        body = parse_generate_body(await read_body(), limits)
        deadline = ttft_deadline(timer, body.deadline_ms, settings.ttft_deadline_ms)
        generation, spec = await _with_spec(runtime, body.to_generation_request(deadline),
                                            body.policy)
        owner = ResumableOwner(runtime.resume_registry(), timer, attach=False, spec=spec)
        stream = await runtime.open_stream(generation, body.policy, owner=owner)
        await _wait_stored(runtime, stream.request_id)
        url = resume_url(stream.request_id)
        if settings.api_key is not None:
            url += f"?{STREAM_TOKEN_PARAM}={stream_token(settings.api_key, stream.request_id)}"
        return json_response({"id": stream.request_id, "stream_url": url}, status=201,
                             headers={"Location": url, "X-Request-ID": stream.request_id})

    @bp.get("/v1/stream/<request_id>")
    async def resume(request_id: str) -> Response:
        """Replay after Last-Event-ID, then follow live (see the module docstring).

        Cancellation: while attaching, nothing changes (the wait for the holder is
        shielded); after, the connection owns the reader.
        """
        registry = runtime.resume_registry()
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
        own_stream(request.scope, reader)
        body = ResumableEventBody(reader, keepalive_s=settings.keepalive_s, send_retry=True,
                                  registry=registry)
        return sse_response(body, request_id, headers={"X-Resume-URL": resume_url(request_id)})

    @bp.delete("/v1/requests/<request_id>")
    async def cancel_request(request_id: str) -> Response:
        """End a resumable stream now: 204, or 404. Cancellation: no checkpoint."""
        if not runtime.resume_registry().cancel(request_id):
            raise ApiError(ErrorType.NOT_FOUND,
                           f"no resumable request {request_id[:64]!r}: unknown or over")
        return Response(b"", status=204)

    return bp
