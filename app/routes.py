"""HTTP routes: streaming and whole-answer generation, health, readiness and statistics.
(The OpenAI-compatible routes are in ``openai_routes.py``; they share these helpers.)

``GET /v1/requests/<id>`` says how the engine let a request go, for as long as the hub
remembers it (the most recent ``streams.hub.RECENT_FINISHES`` finishes): the finish
reason (``eos``, ``length``, ``stop``, ``cancelled`` for a client that left, ``error``),
the prompt and completion token counts, and ``finished_at``, the server's wall-clock
time (``time.time()``) at which the sequence's cache blocks were released. It answers
"what happened to request X" (the id is the stream's ``X-Request-ID``), and the lab uses
it to time the release of a client that left. 404 ``not_found`` while the request is
still running, or if the id is unknown or forgotten.

Each route reads and validates its request, and refuses whatever it can (an envelope
from ``errors.py``) BEFORE a stream opens; after the first byte of a stream a failure is
an SSE ``error`` event and the stream ends. Views know the engine and hub only through
``Runtime``.

Ownership. A stream opened here belongs to the request's connection: quart-trio runs
each request in its own nursery (``StreamingConnection``), whose cancel scope is the
stream's; the stream is a Trio task there (the handler task, which iterates the body)
and its ``close()`` runs on every way out: ``EventStreamBody.__aexit__`` for a stream,
``with stream:`` for ``/v1/generate``, and the connection's backstop for a cancel that
lands between the view's return and Quart entering the body.

The disconnect path, step by step:

1. The client goes: a FIN (clean close) or an RST (abortive close). hypercorn's reader
   sees EOF or a reset (or its next write fails) and puts ``http.disconnect`` into the
   request's ASGI queue.
2. quart-trio's receive loop (``StreamingConnection.handle_messages``), a sibling of the
   handler in the request's nursery, gets it and cancels that nursery's scope with the
   reason ``"client disconnected"``.
3. ``trio.Cancelled`` is raised in the handler task at its current await: usually
   ``stream.receive()`` inside ``EventStreamBody.__anext__``, or a ``send``.
4. It unwinds through Quart's ``async with response.response``, so
   ``EventStreamBody.__aexit__`` calls ``stream.close()``: synchronous, idempotent, never
   a checkpoint, so it runs inside the already-cancelled scope.
5. ``close()`` unregisters the stream, posts ``engine.cancel(id)`` (only a wish, in the
   engine's inbox) and wakes the hub. Cancelled goes on up; nobody swallows it.
6. The hub's step loop wakes (or finishes the step in flight, which may add at most one
   more token) and runs the next step, which applies the cancel at its start.
7. The engine finishes the sequence CANCELLED and releases its cache blocks, once
   (``BlockAllocator.release`` raises on a second release); its FinishEvent reaches the
   hub, which finds no stream and counts it in ``events_dropped``.

A request still waiting for a batch slot takes the same path; at step 7 it leaves the
waiting queue without ever being admitted, so it never held a block.
"""

from __future__ import annotations

import json
from typing import Any

from quart import Blueprint, Response, request

from engine import FinishEvent, TokenEvent
from streams import StreamError, TokenStream

from .connection import own_stream
from .errors import ApiError, ErrorType
from .lifespan import Phase, Runtime
from .metrics import Metrics, RequestTimer
from .schemas import GenerateBody, RequestLimits, parse_generate_body
from .sse_body import EventStreamBody

SSE_HEADERS = {
    "Cache-Control": "no-cache",  # no cache may hold an event back
    "X-Accel-Buffering": "no",  # nor a buffering proxy (nginx honours this header)
}


def make_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """The routes, bound to one app's runtime; each request reports to ``metrics``."""
    bp = Blueprint("streamscope", __name__)
    settings = runtime.settings
    limits = RequestLimits(
        max_prompt_chars=settings.max_prompt_chars,
        max_new_tokens_limit=settings.max_new_tokens_limit,
        default_max_new_tokens=settings.default_max_new_tokens,
        request_policies=settings.request_policies,
    )

    async def read_body() -> GenerateBody:
        """Read (at most MAX_BODY_BYTES: Quart's MAX_CONTENT_LENGTH) and validate.

        Raises: RequestEntityTooLarge (413), pydantic.ValidationError (422).
        Cancellation: while the body arrives; nothing is open yet.
        """
        raw = await request.get_data(cache=False, as_text=False, parse_form_data=False)
        return parse_generate_body(raw, limits)

    @bp.post("/v1/stream")
    async def stream_tokens() -> Response:
        """Open a stream and answer it as ``text/event-stream`` (see ``sse_body.py``).

        Cancellation: before the stream opens, nothing to undo; after, the body (or the
        connection's backstop) closes it.
        """
        timer = metrics.start_request()
        body = await read_body()
        stream = await runtime.open_stream(body.to_generation_request(), body.policy)
        own_stream(request.scope, stream)
        _submitted(timer, stream)
        response = Response(
            EventStreamBody(
                stream, keepalive_s=settings.keepalive_s, pad_bytes=settings.lab_pad_bytes,
                timer=timer,
            ),
            status=200,
            content_type="text/event-stream; charset=utf-8",
            headers={**SSE_HEADERS, "X-Request-ID": stream.request_id},
        )
        response.timeout = None  # Quart's RESPONSE_TIMEOUT (60 s) would cut the stream
        return response

    @bp.post("/v1/generate")
    async def generate() -> Response:
        """The same request through the same hub, answered as one JSON document.

        Cancellation: at ``stream.receive()``; ``with stream`` closes the stream, which
        asks the engine to cancel, as for a stream.
        """
        timer = metrics.start_request()
        body = await read_body()
        with await runtime.open_stream(body.to_generation_request(), body.policy) as stream:
            own_stream(request.scope, stream)
            _submitted(timer, stream)
            text, token_ids, finish = await _collect(stream, timer)
        answer = {
            "id": stream.request_id,
            "text": text,
            "tokens": token_ids,
            "finish_reason": finish.reason.value,
            "usage": {
                "prompt_tokens": finish.prompt_tokens,
                "completion_tokens": finish.completion_tokens,
            },
        }
        return _json(answer, headers={"X-Request-ID": stream.request_id})

    @bp.get("/v1/requests/<request_id>")
    async def finished_request(request_id: str) -> Response:
        """How the engine let a request go (see the module docstring), or 404.

        Cancellation: no checkpoint."""
        finish = runtime.finished(request_id)
        if finish is None:
            raise ApiError(
                ErrorType.NOT_FOUND,
                f"no finished request {request_id[:64]!r}: unknown, still running, or forgotten",
            )
        return _json({
            "id": finish.request_id,
            "finish_reason": finish.reason.value,
            "prompt_tokens": finish.prompt_tokens,
            "completion_tokens": finish.completion_tokens,
            "finished_at": finish.finished_at,
            "error": finish.error,
        })

    @bp.get("/health")
    async def health() -> Response:
        """200 while the process is up (also while the model loads); 503 once the model
        failed to load or a step failed, since this process can serve nothing then.

        Cancellation: no checkpoint."""
        if runtime.phase is Phase.FAILED:
            refusal = runtime.refusal()
            assert refusal is not None
            raise refusal
        return _json({"status": "ok", "phase": runtime.phase.value})

    @bp.get("/ready")
    async def ready() -> Response:
        """200 once the model is loaded and the hub runs; else 503 with the envelope.

        Cancellation: no checkpoint."""
        refusal = runtime.refusal()
        if refusal is not None:
            raise refusal
        return _json({"status": "ready", "phase": runtime.phase.value})

    @bp.get("/stats")
    async def stats() -> Response:
        """The engine's and hub's counters (``Runtime.statistics``). Cancellation: none."""
        return _json(runtime.statistics())

    return bp


def _submitted(timer: RequestTimer, stream: TokenStream) -> None:
    """The engine accepted the request: start its timer's queue time; the connection
    closes the timer (``cancelled`` unless the stream ended) however the request ends."""
    timer.submitted(stream.prompt_tokens)
    own_stream(request.scope, timer)


async def _collect(
    stream: TokenStream, timer: RequestTimer
) -> tuple[str, list[int], FinishEvent]:
    """Read a stream to its end: (text, token ids, finish), or ApiError for a StreamError.

    Cancellation: at ``stream.receive()``; the stream is unchanged.
    """
    text: list[str] = []
    token_ids: list[int] = []
    async for item in stream:
        timer.observe(item)
        match item:
            case TokenEvent():
                text.append(item.text)
                token_ids.append(item.token_id)
            case FinishEvent():
                return "".join(text), token_ids, item
            case StreamError():
                raise ApiError(ErrorType(item.type), item.message)
    raise ApiError(ErrorType.INTERNAL_ERROR, "the stream ended without a result")


def _json(data: dict[str, Any], *, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(data), status=200, content_type="application/json", headers=headers)
