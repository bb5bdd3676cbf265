"""The native routes: ``/v1/stream``, ``/v1/generate`` and ``GET /v1/requests/<id>``.
(The OpenAI-compatible routes are in ``openai.py``, health and statistics in
``health.py``; all of them use ``serving.py``.)

``GET /v1/requests/<id>`` says how the engine let a request go, for as long as the hub
remembers it (the most recent ``streams.router.RECENT_FINISHES`` finishes): the finish
reason (``eos``, ``length``, ``stop``, ``cancelled`` for a client that left, ``error``),
the prompt and completion token counts, and the error message if any. It answers "what
happened to request X" (the id is the stream's ``X-Request-ID``). 404 ``not_found`` while
the request is still running, or if the id is unknown or forgotten. With API keys, a
request's id is its key's (``auth.owned_request``), and another key's is 404 as well.

Each route reads and validates its request, and refuses whatever it can (an envelope
from ``app.errors``) BEFORE a stream opens; after the first byte of a stream a failure is
an SSE ``error`` event and the stream ends. Views know the engine and hub only through
``Runtime``.

Ownership: a route awaits ``Runtime.prepare`` (refusals, deadline, encode), then with no
checkpoint between opens the stream (``Runtime.open``) and hands it to its closer, the
request's connection (``app.edge.connection``); ``docs/cancellation.md`` walks through
what happens when the client goes, step by step.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from ..auth import may_see, owned_request
from ..errors import ApiError, ErrorType
from ..metrics import Metrics
from ..runtime import Runtime
from ..schemas import GenerateBody, RequestLimits, parse_generate_body
from ..wire import NativeEvents, logprobs_data, usage_data
from .body import EventStreamBody
from .health import add_health_routes
from .resumable import open_resumable
from .serving import (
    collect,
    json_response,
    open_owned,
    read_body,
    sse_response,
    ttft_deadline,
)


class NativeViews:
    """The views, bound to one app's runtime; each request reports to ``metrics``."""

    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.limits = RequestLimits.from_settings(runtime.settings)

    async def read(self) -> GenerateBody:
        """Read (``serving.read_body``) and validate.

        Raises: RequestEntityTooLarge (413), pydantic.ValidationError (422).
        Cancellation: while the body arrives; nothing is open yet.
        """
        return parse_generate_body(await read_body(), self.limits)

    async def stream_tokens(self) -> Response:
        """Open a stream and answer it as ``text/event-stream`` (``body.py``).

        Cancellation: before the stream opens, nothing to undo; after, the body (or the
        connection's backstop) closes it.
        """
        timer = self.metrics.start_request()
        body = await self.read()
        deadline = ttft_deadline(timer, body.deadline_ms, self.runtime.settings.ttft_deadline_ms)
        generation = body.to_generation_request(deadline)
        if body.resumable:
            return await open_resumable(self.runtime, generation, body.policy, timer)
        prepared = await self.runtime.prepare(owned_request(generation), body.policy)
        stream = open_owned(self.runtime, prepared, timer)
        events = NativeEvents(stream.request_id, stream.prompt_tokens)
        return sse_response(
            EventStreamBody(stream, events, keepalive_s=self.runtime.settings.keepalive_s,
                            keepalives=self.runtime.keepalives,
                            timer=timer),
            stream.request_id,
        )

    async def generate(self) -> Response:
        """The same request through the same hub, answered as one JSON document.

        Cancellation: at ``stream.receive()``; ``with stream`` closes the stream, which
        asks the engine to cancel, as for a stream.
        """
        timer = self.metrics.start_request()
        body = await self.read()
        if body.resumable:
            raise ApiError(ErrorType.INVALID_REQUEST,
                           "resumable applies to /v1/stream and /v1/requests only")
        deadline = ttft_deadline(timer, body.deadline_ms, self.runtime.settings.ttft_deadline_ms)
        prepared = await self.runtime.prepare(owned_request(body.to_generation_request(deadline)),
                                              body.policy)
        stream = open_owned(self.runtime, prepared, timer)
        with stream:
            text, tokens, finish = await collect(stream, timer)
        answer: dict[str, Any] = {
            "id": stream.request_id,
            "text": text,
            "tokens": [t.token_id for t in tokens],
            "finish_reason": finish.reason.value,
            "usage": usage_data(finish),
        }
        if body.logprobs:  # a token's entry as in its token event, one per token
            answer["logprobs"] = [None if t.logprobs is None else logprobs_data(t.logprobs)
                                  for t in tokens]
        return json_response(answer, headers={"X-Request-ID": stream.request_id})

    async def finished_request(self, request_id: str) -> Response:
        """How the engine let a request go (see the module docstring), or 404.

        Cancellation: no checkpoint."""
        finish = self.runtime.finished(request_id) if may_see(request_id) else None
        if finish is None:  # another API key's request too: as if it never was
            raise ApiError(
                ErrorType.NOT_FOUND,
                f"no finished request {request_id[:64]!r}: unknown, still running, or forgotten",
            )
        return json_response({
            "id": finish.request_id,
            "finish_reason": finish.reason.value,
            **usage_data(finish),
            "error": finish.error,
        })


def make_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """``/v1/stream``, ``/v1/generate``, ``GET /v1/requests/<id>``, and the health routes
    (``health.py``)."""
    bp = Blueprint("streamscope", __name__)
    views = NativeViews(runtime, metrics)
    bp.add_url_rule("/v1/stream", view_func=views.stream_tokens, methods=["POST"])
    bp.add_url_rule("/v1/generate", view_func=views.generate, methods=["POST"])
    bp.add_url_rule("/v1/requests/<request_id>", view_func=views.finished_request,
                    methods=["GET"])
    add_health_routes(bp, runtime)
    return bp
