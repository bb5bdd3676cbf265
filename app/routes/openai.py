"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

A blueprint of its own, so that its error handler answers every refusal of these routes
in OpenAI's shape (``openai_errors.OpenAIError``), the API key's 401 included; the other
routes keep our envelope. A request is read and validated (``app.schemas``), its
``model`` checked, chat messages rendered by the model's own chat template and encoded
(``Runtime.render_chat``), and then it runs exactly like ``/v1/stream`` or
``/v1/generate``: the same ``Runtime.open``, closer, timer and disconnect path
(``docs/cancellation.md`` walks through it); only the bytes differ (``app.wire``:
``OpenAIChunks`` in the route's ``ChoiceShape``, ``whole_answer``).

A ``response_format`` or ``tools`` constrain the answer (``app.schemas.tools``): the
constraint is compiled in ``Runtime.prepare``, and one that does not compile is a 400
naming the field, before the first byte. A chat answer with tools is read as the
generic tool format and sent as OpenAI's tool calls (``app.wire``'s ``tool_message``,
``OpenAIChunks(tools=True)``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from quart import Blueprint, Quart, Response

from engine import InvalidConstraint

from ..auth import key_name, owned_request
from ..error_handlers import answer_errors_under, error_response
from ..errors import ApiError, ErrorType
from ..metrics import Metrics, RequestTimer
from ..runtime import Prepared, Runtime
from ..schemas import ChatBody, CompletionsBody, OpenAIBody, RequestLimits
from ..wire import CHAT, COMPLETION, ChoiceShape, OpenAIChunks, tool_message, whole_answer
from .body import EventStreamBody
from .openai_errors import OpenAIError, ServedModels, openai_error_envelope, openai_error_for
from .serving import (
    collect,
    json_response,
    open_owned,
    read_body,
    sse_response,
    ttft_deadline,
)


class OpenAIViews:
    """The views, bound to one app's runtime; each request reports to ``metrics``."""

    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self.runtime = runtime
        self.metrics = metrics
        settings = runtime.settings
        self.limits = RequestLimits.from_settings(settings)
        self.models = ServedModels(settings.model, settings.model_name, created=int(time.time()))

    def deadline_of(self, timer: RequestTimer, body: OpenAIBody) -> float | None:
        return ttft_deadline(timer, body.deadline_ms, self.runtime.settings.ttft_deadline_ms)

    async def list_models(self) -> Response:
        """The served model and its alias. Cancellation: no checkpoint."""
        return json_response(self.models.listing())

    async def retrieve_model(self, model_id: str) -> Response:
        """One model's card, or 404 model_not_found. Cancellation: no checkpoint."""
        return json_response(self.models.card(self.models.check(model_id)))

    async def completions(self) -> Response:
        """A prompt, continued. Cancellation: see ``answer``."""
        timer = self.metrics.start_request()
        body = CompletionsBody.model_validate_json(await read_body(), context=self.limits)
        model = self.models.check(body.model)
        generation = body.generation_request(body.prompt, self.limits,
                                             ttft_deadline=self.deadline_of(timer, body))
        with refused_constraint(body):
            prepared = await self.runtime.prepare(owned_request(generation), None)
        return await self.answer(prepared, timer, body, model, COMPLETION)

    async def chat_completions(self) -> Response:
        """Messages, rendered by the model's chat template, answered by the assistant.

        Cancellation: while the template renders and encodes (never abandoned;
        milliseconds), nothing was made; then see ``answer``.
        """
        timer = self.metrics.start_request()
        body = ChatBody.model_validate_json(await read_body(), context=self.limits)
        model = self.models.check(body.model)

        text, prompt_ids = await self.runtime.render_chat(body.template_input(),
                                                          body.add_generation_prompt,
                                                          key_name())
        generation = body.generation_request(text, self.limits, prompt_ids,
                                             ttft_deadline=self.deadline_of(timer, body))
        with refused_constraint(body):
            prepared = await self.runtime.prepare(owned_request(generation), None)
        return await self.answer(prepared, timer, body, model, CHAT,
                                 tools=body.tool_use() is not None)

    async def answer(self, prepared: Prepared, timer: RequestTimer, body: OpenAIBody,
                     model: str, shape: ChoiceShape, *, tools: bool = False) -> Response:
        """Open the stream (no checkpoint between the open and its closer taking it) and
        answer it as chunks or as one document (``tools``: in the generic tool format).

        Cancellation: a whole answer's at the stream's receive (``with stream`` closes
        it); a streaming one's in the body, or the connection's backstop, closes it.
        """
        stream = open_owned(self.runtime, prepared, timer)
        if body.is_streaming:
            chunks = OpenAIChunks(shape, stream.request_id, model,
                                  error_envelope=openai_error_envelope,
                                  include_usage=body.include_usage, tools=tools)
            return sse_response(
                EventStreamBody(stream, chunks, keepalive_s=self.runtime.settings.keepalive_s,
                                keepalives=self.runtime.keepalives,
                                timer=timer),
                stream.request_id,
            )
        with stream:
            text, tokens, finish = await collect(stream, timer)
        answer = whole_answer(shape, stream.request_id, model, text, finish, tokens)
        if tools:
            choice = answer["choices"][0]
            choice["message"], called = tool_message(stream.request_id, text)
            choice["logprobs"] = None
            if called and choice["finish_reason"] != "length":
                choice["finish_reason"] = "tool_calls"
        return json_response(answer, headers={"X-Request-ID": stream.request_id})

    async def refuse(self, exc: Exception) -> Response:
        """Every error of these routes, in OpenAI's shape. Cancellation: no checkpoint."""
        error = openai_error_for(exc)
        self.metrics.refused(error)
        return error_response(error)


@contextmanager
def refused_constraint(body: OpenAIBody) -> Iterator[None]:
    """A constraint that does not compile as a 400 naming its field (``tools`` or
    ``response_format``)."""
    try:
        yield
    except InvalidConstraint as exc:
        raise OpenAIError(ApiError(ErrorType.INVALID_CONSTRAINT, str(exc)),
                          param=body.constraint_param) from None


def make_openai_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """The OpenAI routes, bound to one app's runtime; each request reports to ``metrics``."""
    bp = Blueprint("openai", __name__)
    views = OpenAIViews(runtime, metrics)
    bp.add_url_rule("/v1/models", view_func=views.list_models, methods=["GET"])
    bp.add_url_rule("/v1/models/<path:model_id>", view_func=views.retrieve_model,
                    methods=["GET"])
    bp.add_url_rule("/v1/completions", view_func=views.completions, methods=["POST"])
    bp.add_url_rule("/v1/chat/completions", view_func=views.chat_completions,
                    methods=["POST"])
    bp.register_error_handler(Exception, views.refuse)
    # A wrong method, an unknown path below these, a 401 there: OpenAI's shape.
    bp.record_once(lambda state: answer_openai_errors(state.app))  # type: ignore[arg-type]
    return bp


def answer_openai_errors(app: Quart) -> None:
    for prefix in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
        answer_errors_under(app, prefix, openai_error_for)
