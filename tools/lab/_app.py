"""The lab's server: the service's app plus the laboratory devices, which the product lacks.

``python -m tools.lab`` serves ``tools.lab._asgi:app`` (``common.open_lab_server``), built
by ``create_lab_app``: ``app.factory.create_app()`` as a user runs it, then

* the flood probe (``_flood.py``): ``POST /v1/lab/flood``, ``GET /v1/lab/flood/<id>``
  (the buffers experiment);
* ``GET /v1/lab/requests/<id>``: the service's ``GET /v1/requests/<id>`` record plus
  ``finished_at``, the wall-clock time (``time.time()``) at which the engine's step handed
  the request's finish out (the disconnect and slowclient experiments time a release by
  it, against a client's own ``time.time()`` on the same machine). A cancel's finish is
  handed out (``on_prefill``) as soon as the step's start has applied it and released its
  blocks, before any forward pass; a finish the decode pass makes is stamped when the
  step returns. The engine stays as it is: ``FinishClock`` wraps its ``step`` in place;
* ``GET /v1/lab/queues``: how many items each open ``/v1/stream`` stream has queued for
  its reader now (``TokenStream.statistics().queued``), by request id (the logprobs
  experiment polls it for the peak a slow reader's stream holds);
* ``STREAMSCOPE_LAB_PAD_BYTES`` (0, off, by default): each token event of ``/v1/stream``
  is followed by an SSE comment of that many bytes (at least 2), built as it is written,
  so that a slow reader meets real backpressure (the slowclient experiment);
* ``STREAMSCOPE_LAB_DETECT_DISCONNECT=false``: a stream never learns that its client
  left: the connection notes ``http.disconnect`` and does not cancel the request's scope
  (hypercorn drops the bytes written after that without an error). The disconnect
  experiment's control;
* ``STREAMSCOPE_LAB_KV_ADMISSION=reserve``: the engine reserves every block a request
  may need at admission (``reservation.py``, injected through ``Engine(admission=...)``):
  the capacity experiment's comparison;
* ``STREAMSCOPE_LAB_NAIVE=true``: the step loop waits for the reader of every stream on
  the default policy after each step (``naive.py``, injected as the hub's ``run_step``
  with streams it can wait for: ``create_app(make_hub=...)``): the slowclient
  experiment's ``naive``.

The lab's settings are its own ``STREAMSCOPE_LAB_*`` variables. The service refuses them
(they are not its settings), so ``_asgi.py`` and ``_serve.py`` give the service the
environment without them (``_settings.split_lab_environ``).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable

import trio
from hypercorn.typing import ASGIReceiveCallable
from quart import Blueprint, Response, request
from quart.asgi import ASGIHTTPConnection
from quart.wrappers import Request

from app.edge.connection import StreamingConnection
from app.errors import ApiError, ErrorType
from app.factory import StreamscopeApp, create_app
from app.routes.body import EventStreamBody
from app.routes.serving import json_response
from app.runtime import MakeEngine, Runtime, ServingEngine, load_engine_from_settings
from app.settings import Settings
from app.wire import NativeEvents, usage_data
from engine import EngineEvent, FinishEvent, TokenEvent
from streams import StreamItem, StreamState, TokenStream
from tools.lab._flood import make_flood_blueprint
from tools.lab._settings import LabSettings, lab_padding
from tools.lab.naive import NaiveStepping
from tools.lab.reservation import load_reserving_engine

RECENT_FINISH_TIMES = 4096  # finish times kept for GET /v1/lab/requests/<id>


class PaddedEvents:
    """``/v1/stream``'s events (``NativeEvents``) with each token event followed by the
    lab's padding: the encoder of the view's body, swapped before Quart enters it."""

    def __init__(self, events: NativeEvents, pad_bytes: int) -> None:
        self._events = events
        self._padding = lab_padding(pad_bytes)

    def opening(self) -> bytes:
        return self._events.opening()

    def encode(self, items: list[StreamItem]) -> bytes:
        return b"".join(
            self._events.encode([item]) + self._padding if isinstance(item, TokenEvent)
            else self._events.encode([item])
            for item in items
        )

    def error(self, error_type: str, message: str) -> bytes:
        return self._events.error(error_type, message)

    def keepalive(self) -> bytes:
        return self._events.keepalive()


class UnheedingConnection(StreamingConnection):
    """A connection that notes its client's disconnect and does not cancel the request."""

    async def handle_messages(  # type: ignore[override]
        self, nursery: trio.Nursery, request: Request, receive: ASGIReceiveCallable
    ) -> None:
        """Feed the request body to Quart; on ``http.disconnect`` only count it.

        Cancellation: nothing to undo: the loop only feeds the body; it is cancelled when
        the handler finished or the server stops (a disconnect no longer cancels here),
        and the streams the request opened are closed by their owner, the connection
        (``StreamingConnection.__call__``).
        """
        await ASGIHTTPConnection.handle_messages(self, request, receive)
        self.note_disconnect()


class FinishClock:
    """The wall-clock time at which the engine's step handed each finish out.

    ``attach`` wraps an engine's ``step`` in place (the engine keeps its type); the stamps
    are taken in the stepping thread, read in the Trio thread, under a lock.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._times: OrderedDict[str, float] = OrderedDict()

    def attach(self, engine: ServingEngine) -> ServingEngine:
        step = engine.step

        def stamped_step(
            on_prefill: Callable[[list[EngineEvent]], None] | None = None,
        ) -> list[EngineEvent]:
            def stamp_then_hand_over(events: list[EngineEvent]) -> None:
                self.stamp(events)
                assert on_prefill is not None
                on_prefill(events)

            events = step(on_prefill=None if on_prefill is None else stamp_then_hand_over)
            self.stamp(events)
            return events

        engine.step = stamped_step  # type: ignore[method-assign]
        return engine

    def stamp(self, events: list[EngineEvent]) -> None:
        now = time.time()
        with self._lock:
            for event in events:
                if isinstance(event, FinishEvent):
                    self._times[event.request_id] = now
            while len(self._times) > RECENT_FINISH_TIMES:
                self._times.popitem(last=False)

    def finished_at(self, request_id: str) -> float | None:
        with self._lock:
            return self._times.get(request_id)


class QueueWatch:
    """The open streams of ``/v1/stream`` bodies, by request id, held weakly."""

    def __init__(self) -> None:
        self._streams: weakref.WeakValueDictionary[str, TokenStream] = (
            weakref.WeakValueDictionary())

    def add(self, stream: TokenStream) -> None:
        self._streams[stream.request_id] = stream

    def queued(self) -> dict[str, int]:
        """Items queued for each stream not yet closed."""
        found = {}
        for request_id, stream in list(self._streams.items()):
            statistics = stream.statistics()
            if statistics.state is StreamState.CLOSED:
                self._streams.pop(request_id, None)
            else:
                found[request_id] = statistics.queued
        return found


def make_lab_blueprint(runtime: Runtime, clock: FinishClock, watch: QueueWatch) -> Blueprint:
    """``GET /v1/lab/requests/<id>`` and ``GET /v1/lab/queues`` (the module docstring)."""
    bp = Blueprint("streamscope_lab", __name__)

    @bp.get("/v1/lab/queues")
    async def queues() -> Response:
        """``{"queued": {request id: items}}``. Cancellation: nothing to undo: a read,
        with no checkpoint for a cancel to land at."""
        return json_response({"queued": watch.queued()})

    @bp.get("/v1/lab/requests/<request_id>")
    async def finished_request(request_id: str) -> Response:
        """The finish record with ``finished_at``, or 404. Cancellation: nothing to undo:
        a read, with no checkpoint for a cancel to land at."""
        finish, at = runtime.finished(request_id), clock.finished_at(request_id)
        if finish is None or at is None:
            raise ApiError(ErrorType.NOT_FOUND, f"no finished request {request_id[:64]!r}")
        return json_response({
            "id": finish.request_id,
            "finish_reason": finish.reason.value,
            **usage_data(finish),
            "finished_at": at,
            "error": finish.error,
        })

    return bp


def create_lab_app(
    settings: Settings | None = None,
    lab: LabSettings | None = None,
    *,
    make_engine: MakeEngine | None = None,
    drain_on_sigterm: bool = False,
) -> StreamscopeApp:
    """``create_app`` with the laboratory devices (see the module docstring).

    Args:
        settings, make_engine, drain_on_sigterm: as ``create_app``'s.
        lab: the devices; default ``LabSettings()``: the flood and the finish clock only.
    """
    lab = LabSettings() if lab is None else lab
    clock = FinishClock()
    loader = load_reserving_engine if lab.kv_admission == "reserve" else load_engine_from_settings
    build = make_engine or loader
    # The naive device makes the hub: its run_step seam and streams it waits for (naive.py).
    make_hub = NaiveStepping().make_hub if lab.naive else None
    app = create_app(settings, make_engine=lambda s: clock.attach(build(s)),
                     drain_on_sigterm=drain_on_sigterm, make_hub=make_hub)
    app.register_blueprint(make_flood_blueprint())
    watch = QueueWatch()
    app.register_blueprint(make_lab_blueprint(app.runtime, clock, watch))
    if not lab.detect_disconnect:
        app.asgi_http_class = UnheedingConnection

    @app.after_request
    async def watch_queues(response: Response) -> Response:
        """Note a ``/v1/stream`` body's stream. Cancellation: nothing to undo: no
        checkpoint, and the watch holds the stream weakly, so it stays its connection's
        to close."""
        body = response.response
        if (request.path == "/v1/stream" and isinstance(body, EventStreamBody)
                and isinstance(body.source, TokenStream)):
            watch.add(body.source)
        return response

    if lab.pad_bytes:

        @app.after_request
        async def pad_token_events(response: Response) -> Response:
            """Pad a plain ``/v1/stream`` body. Cancellation: nothing to undo: no
            checkpoint; the new body wraps the same stream, still its connection's to
            close."""
            body = response.response
            if (request.path == "/v1/stream" and isinstance(body, EventStreamBody)
                    and type(body.encoder) is NativeEvents):
                response.response = EventStreamBody(
                    body.source, PaddedEvents(body.encoder, lab.pad_bytes),
                    keepalive_s=body.keepalive_s, keepalives=body.keepalives,
                    timer=body.timer,
                )
            return response

    return app
