"""HTTP routes: streaming and whole-answer generation, health, readiness and statistics.
(The OpenAI-compatible routes are in ``openai_routes.py``; both use ``serving.py``.)

``GET /v1/requests/<id>`` says how the engine let a request go, for as long as the hub
remembers it (the most recent ``streams.hub.RECENT_FINISHES`` finishes): the finish
reason (``eos``, ``length``, ``stop``, ``cancelled`` for a client that left, ``error``),
the prompt and completion token counts, and the error message if any. It answers "what
happened to request X" (the id is the stream's ``X-Request-ID``). 404 ``not_found`` while
the request is still running, or if the id is unknown or forgotten.

Each route reads and validates its request, and refuses whatever it can (an envelope
from ``errors.py``) BEFORE a stream opens; after the first byte of a stream a failure is
an SSE ``error`` event and the stream ends. Views know the engine and hub only through
``Runtime``.

Ownership: ``serving.open_owned_stream`` opens every stream with its owner (the
request's connection) registered in the same call; ``docs/cancellation.md`` walks
through what happens when the client goes, step by step.
"""

from __future__ import annotations

from quart import Blueprint, Response

from .errors import ApiError, ErrorType
from .lifespan import Phase, Runtime
from .metrics import Metrics, RequestTimer
from .resumable import open_resumable
from .schemas import GenerateBody, RequestLimits, parse_generate_body
from .serving import (
    collect,
    json_response,
    open_owned_stream,
    read_body,
    sse_response,
    ttft_deadline,
)
from .sse_body import EventStreamBody


def make_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """The routes, bound to one app's runtime; each request reports to ``metrics``."""
    bp = Blueprint("streamscope", __name__)
    settings = runtime.settings
    limits = RequestLimits.from_settings(settings)

    async def read_generate_body() -> GenerateBody:
        """Read (``serving.read_body``) and validate.

        Raises: RequestEntityTooLarge (413), pydantic.ValidationError (422).
        Cancellation: while the body arrives; nothing is open yet.
        """
        return parse_generate_body(await read_body(), limits)

    def deadline_of(timer: RequestTimer, body: GenerateBody) -> float | None:
        return ttft_deadline(timer, body.deadline_ms, settings.ttft_deadline_ms)

    @bp.post("/v1/stream")
    async def stream_tokens() -> Response:
        """Open a stream and answer it as ``text/event-stream`` (see ``sse_body.py``).

        Cancellation: before the stream opens, nothing to undo; after, the body (or the
        connection's backstop) closes it.
        """
        timer = metrics.start_request()
        body = await read_generate_body()
        generation = body.to_generation_request(deadline_of(timer, body))
        if body.resumable:
            return await open_resumable(runtime, generation, body.policy, timer)
        stream = await open_owned_stream(runtime, generation, body.policy, timer)
        return sse_response(
            EventStreamBody(
                stream, keepalive_s=settings.keepalive_s, timer=timer,
            ),
            stream.request_id,
        )

    @bp.post("/v1/generate")
    async def generate() -> Response:
        """The same request through the same hub, answered as one JSON document.

        Cancellation: at ``stream.receive()``; ``with stream`` closes the stream, which
        asks the engine to cancel, as for a stream.
        """
        timer = metrics.start_request()
        body = await read_generate_body()
        if body.resumable:
            raise ApiError(ErrorType.INVALID_REQUEST,
                           "resumable applies to /v1/stream and /v1/requests only")
        generation = body.to_generation_request(deadline_of(timer, body))
        with await open_owned_stream(runtime, generation, body.policy, timer) as stream:
            text, token_ids, finish = await collect(stream, timer)
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
        return json_response(answer, headers={"X-Request-ID": stream.request_id})

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
        return json_response({
            "id": finish.request_id,
            "finish_reason": finish.reason.value,
            "prompt_tokens": finish.prompt_tokens,
            "completion_tokens": finish.completion_tokens,
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
        return json_response({"status": "ok", "phase": runtime.phase.value})

    @bp.get("/ready")
    async def ready() -> Response:
        """200 once the model is loaded and the hub runs, and the shared resume store
        (if set) answers; else 503 with the envelope.

        Cancellation: while the store is asked, nothing changes."""
        refusal = runtime.refusal() or await runtime.store_refusal()
        if refusal is not None:
            raise refusal
        return json_response({"status": "ready", "phase": runtime.phase.value})

    @bp.get("/stats")
    async def stats() -> Response:
        """The engine's and hub's counters (``Runtime.statistics``). Cancellation: none."""
        return json_response(runtime.statistics())

    return bp

