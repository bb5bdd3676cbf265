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

Both generating routes run the one pipeline (``pipeline.py``) with ``NativeAdapter``;
``/v1/stream`` with ``resumable`` (and ``POST /v1/requests``, ``resumable.py``) opens its
stream in the resume registry (``registry_owned.py``) instead.

Ownership: a route awaits ``Runtime.prepare`` (refusals, deadline, encode), then with no
checkpoint between opens the stream (``Runtime.open``) and hands it to its closer, the
request's connection (``app.edge.connection``); ``docs/cancellation.md`` walks through
what happens when the client goes, step by step.
"""

from __future__ import annotations

from typing import Any

from quart import Blueprint, Response

from streams import TokenStream

from ..auth import may_see
from ..errors import ApiError, ErrorType
from ..metrics import Metrics
from ..runtime import Runtime
from ..schemas import GenerateBody, RequestLimits, parse_generate_body
from ..wire import Encoder, NativeEvents, logprobs_data, usage_data
from .body import EventStreamBody
from .health import add_health_routes
from .pipeline import Adapter, Call, Collected, Pipeline, Prompt, Terms, answer_owned
from .registry_owned import open_registry_owned, resume_url
from .resume_source import LoggedEvents, ResumeSource
from .serving import json_response, sse_response


class NativeAdapter(Adapter[GenerateBody]):
    """The native API's part of the pipeline: ``/v1/stream`` (``streaming``, answered
    as ``text/event-stream``, ``body.py``) or ``/v1/generate`` (the same request through
    the same hub, answered as one JSON document)."""

    def __init__(self, *, streaming: bool) -> None:
        self.streaming = streaming

    def parse(self, raw: bytes, limits: RequestLimits) -> GenerateBody:
        """Validate (``schemas.parse_generate_body``).

        Raises: pydantic.ValidationError (422); ApiError invalid_request for
        ``resumable`` on ``/v1/generate``."""
        body = parse_generate_body(raw, limits)
        if body.resumable and not self.streaming:
            raise ApiError(ErrorType.INVALID_REQUEST,
                           "resumable applies to /v1/stream and /v1/requests only")
        return body

    async def prompt(self, runtime: Runtime, body: GenerateBody) -> Prompt:
        """The body's prompt as it is (encoded in ``Runtime.prepare``). No checkpoint."""
        return Prompt(body.prompt)

    def terms(self, body: GenerateBody) -> Terms:
        return Terms(body.deadline_ms, body.policy, registry_owned=self.registry_owned(body))

    def registry_owned(self, body: GenerateBody) -> bool:
        return body.resumable

    async def answer(self, call: Call[GenerateBody]) -> Response:
        """The events, the whole document, or (``resumable``) the registry's stream.

        Cancellation: closed by its owner (``pipeline.answer_owned``): a whole answer's
        at ``stream.receive()`` (``with source`` closes the stream, which asks the engine
        to cancel); a streaming one's in the body, or the connection's backstop, closes
        it. A resumable one is handed over (``answer_resumable``).
        """
        if call.body.resumable:
            return await answer_resumable(call)
        return await answer_owned(call, lambda streams: NativeAnswer(call.body, streams[0]),
                                  streaming=self.streaming)


async def answer_resumable(call: Call[GenerateBody]) -> Response:
    """``POST /v1/stream`` with ``resumable``: open the stream in the registry and answer
    it with its first reader.

    Cancellation: nothing to undo before the stream opens; after, handed over: the
    registry owns the stream and the connection only its reader. No checkpoint here.
    """
    runtime = call.runtime
    stream, reader = open_registry_owned(runtime, call.prepared, call.spec, call.timer,
                                         attach=True)
    assert reader is not None  # attach=True
    body = EventStreamBody(ResumeSource(reader), LoggedEvents(send_retry=False),
                           keepalive_s=runtime.settings.keepalive_s)
    return sse_response(body, stream.request_id,
                        headers={"X-Resume-URL": resume_url(stream.request_id)})


class NativeAnswer:
    """The native events of one stream, or its whole answer."""

    def __init__(self, body: GenerateBody, stream: TokenStream) -> None:
        self.body = body
        self.stream = stream

    def headers(self) -> dict[str, str]:
        return {}

    def encoder(self) -> Encoder[Any]:
        return NativeEvents(self.stream.request_id, self.stream.prompt_tokens)

    async def whole(self, results: list[Collected]) -> dict[str, Any]:
        """Cancellation: nothing to undo, as none can land: no checkpoint."""
        text, tokens, finish = results[0]
        answer: dict[str, Any] = {
            "id": self.stream.request_id,
            "text": text,
            "tokens": [t.token_id for t in tokens],
            "finish_reason": finish.reason.value,
            "usage": usage_data(finish),
        }
        if self.body.logprobs:  # a token's entry as in its token event, one per token
            answer["logprobs"] = [None if t.logprobs is None else logprobs_data(t.logprobs)
                                  for t in tokens]
        return answer


def finished_request(runtime: Runtime) -> Any:
    """``GET /v1/requests/<id>``, bound to one app's runtime."""

    async def view(request_id: str) -> Response:
        """How the engine let a request go (see the module docstring), or 404.

        Cancellation: nothing to undo, as none can land: no checkpoint."""
        finish = runtime.finished(request_id) if may_see(request_id) else None
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
    return view


def make_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """``/v1/stream``, ``/v1/generate``, ``GET /v1/requests/<id>``, and the health routes
    (``health.py``)."""
    bp = Blueprint("streamscope", __name__)
    pipeline = Pipeline(runtime, metrics)
    bp.add_url_rule("/v1/stream", "stream_tokens",
                    pipeline.view(NativeAdapter(streaming=True)), methods=["POST"])
    bp.add_url_rule("/v1/generate", "generate",
                    pipeline.view(NativeAdapter(streaming=False)), methods=["POST"])
    bp.add_url_rule("/v1/requests/<request_id>", "finished_request",
                    finished_request(runtime), methods=["GET"])
    add_health_routes(bp, runtime)
    return bp
