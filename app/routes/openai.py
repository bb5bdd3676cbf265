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
from typing import Any

from quart import Blueprint, Quart, Response

from engine import InvalidConstraint

from ..auth import key_name, owned_request
from ..error_handlers import answer_errors_under, error_response
from ..errors import ApiError, ErrorType
from ..metrics import Metrics, RequestTimer
from ..runtime import Prepared, Runtime
from ..schemas import ChatBody, CompletionsBody, OpenAIBody, RequestLimits
from ..wire import (
    CHAT,
    COMPLETION,
    ChoiceShape,
    OpenAIChunks,
    choices_usage,
    tool_message,
    whole_answer,
)
from .body import EventStreamBody
from .choices import ChoiceItem, ChoicesSource, choices_prepared, collect_choices
from .openai_errors import OpenAIError, ServedModels, openai_error_envelope, openai_error_for
from .serving import (
    collect,
    json_response,
    open_choices,
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
            prepared = await self.runtime.prepare(owned_request(generation), None,
                                                  new_tokens_field="max_tokens")
        if body.choices > 1:
            return await self.answer_choices(choices_prepared(prepared, generation, body.choices),
                                             timer, body, model, COMPLETION)
        return await self.answer(prepared, timer, body, model, COMPLETION)

    async def chat_completions(self) -> Response:
        """Messages, rendered by the model's chat template, answered by the assistant.

        Cancellation: while the template renders and encodes (never abandoned;
        milliseconds), nothing was made; then see ``answer``.
        """
        timer = self.metrics.start_request()
        body = ChatBody.model_validate_json(await read_body(), context=self.limits)
        model = self.models.check(body.model)
        body.speak_tools_of(self.runtime.engine)  # its template's tool format, if any
        text, prompt_ids = await self.runtime.render_chat(body.template_input(),
                                                          body.add_generation_prompt,
                                                          key_name(), body.template_tools())
        self.refuse_unused_field(body)
        generation = body.generation_request(text, self.limits, prompt_ids,
                                             ttft_deadline=self.deadline_of(timer, body))
        with refused_constraint(body):
            prepared = await self.runtime.prepare(owned_request(generation), None,
                                                  new_tokens_field=body.new_tokens_field())
        tools = body.tool_format()
        if body.choices > 1:
            return await self.answer_choices(choices_prepared(prepared, generation, body.choices),
                                             timer, body, model, CHAT, tools=tools)
        return await self.answer(prepared, timer, body, model, CHAT, tools=tools)

    def refuse_unused_field(self, body: ChatBody) -> None:
        """``reasoning_effort`` is accepted, and changes nothing, where the model's chat
        template has no use for it (as vLLM does); a template that reads it would be
        rendered without it, so there it is refused (400 naming it). Sync."""
        engine = self.runtime.engine
        if (body.reasoning_effort is not None and engine is not None
                and engine.chat_template_uses("reasoning_effort")):
            raise OpenAIError(ApiError(
                ErrorType.INVALID_REQUEST, "this model's chat template reads reasoning_effort, "
                "which this server does not pass to it"), param="reasoning_effort")

    async def answer(self, prepared: Prepared, timer: RequestTimer, body: OpenAIBody,
                     model: str, shape: ChoiceShape, *, tools: str | None = None) -> Response:
        """Open the stream (no checkpoint between the open and its closer taking it) and
        answer it as chunks or as one document (``tools``: the tool format it is in).

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
            with_tool_calls(answer["choices"][0], stream.request_id, text, tools)
        return json_response(answer, headers={"X-Request-ID": stream.request_id})

    async def answer_choices(self, prepared: list[Prepared], timer: RequestTimer,
                             body: OpenAIBody, model: str, shape: ChoiceShape, *,
                             tools: str | None = None) -> Response:
        """``answer`` for several choices (``choices.py``): a stream each, opened back to
        back (the prefix cache serves the prompt to all but the first), read as one.

        Cancellation: as ``answer``; the connection closes every stream."""
        streams = open_choices(self.runtime, prepared, timer)
        source = ChoicesSource(streams)
        first = streams[0].request_id
        if body.is_streaming:
            chunks = OpenAIChunks(shape, first, model, error_envelope=openai_error_envelope,
                                  include_usage=body.include_usage, tools=tools,
                                  choices=[s.request_id for s in streams])
            return sse_response(EventStreamBody[ChoiceItem](source, chunks,
                                                keepalive_s=self.runtime.settings.keepalive_s,
                                                timer=timer), first)
        with source:
            results = await collect_choices(source, timer)
        choices = []
        for index, (text, tokens, finish) in enumerate(results):
            choice = whole_answer(shape, first, model, text, finish, tokens)["choices"][0]
            choice["index"] = index
            if tools:
                with_tool_calls(choice, streams[index].request_id, text, tools)
            choices.append(choice)
        text, tokens, finish = results[0]
        answer = whole_answer(shape, first, model, text, finish, tokens)
        answer["choices"] = choices
        answer["usage"] = choices_usage([finish for _, _, finish in results])
        return json_response(answer, headers={"X-Request-ID": first})

    async def refuse(self, exc: Exception) -> Response:
        """Every error of these routes, in OpenAI's shape. Cancellation: no checkpoint."""
        error = openai_error_for(exc)
        self.metrics.refused(error)
        return error_response(error)


def with_tool_calls(choice: dict[str, Any], request_id: str, text: str,
                    tools: str = "generic") -> None:
    """A chat choice whose answer is in the tool format ``tools``, as OpenAI's message:
    its tool calls, and ``tool_calls`` as its finish reason if it made any (and was not
    cut short)."""
    choice["message"], called = tool_message(request_id, text, tools)
    choice["logprobs"] = None
    if called and choice["finish_reason"] != "length":
        choice["finish_reason"] = "tool_calls"


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
