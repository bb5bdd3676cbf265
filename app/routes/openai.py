"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

A blueprint of its own, so that its error handler answers every refusal of these routes
in OpenAI's shape (``openai_errors.OpenAIError``), the API key's 401 included; the other
routes keep our envelope. A request is read and validated (``app.schemas``), its
``model`` checked, chat messages rendered by the model's own chat template and encoded
(``Runtime.render_chat``), and then it runs exactly like ``/v1/stream`` or
``/v1/generate``: the one pipeline (``pipeline.py``, with ``CompletionsAdapter`` or
``ChatAdapter``), the same ``Runtime.open``, closer, timer and disconnect path
(``docs/cancellation.md`` walks through it); only the bytes differ (``app.wire``:
``OpenAIChunks`` in the route's ``ChoiceShape``, ``whole_answer``).

A ``response_format`` or ``tools`` constrain the answer (``app.schemas.tools``): the
constraint is compiled in ``Runtime.prepare``, and one that does not compile is a 400
naming the field, before the first byte. A chat answer with tools is read in its
tool format (the generic one, or the model's own: ``app.schemas.tool_formats``) and
sent as OpenAI's tool calls (``app.wire``'s ``tool_message``, ``OpenAIChunks(tools=...)``).
"""

from __future__ import annotations

import time
from typing import Any

from quart import Blueprint, Quart, Response

from streams import TokenStream

from ..auth import key_name
from ..error_handlers import answer_errors_under
from ..errors import ApiError
from ..metrics import Metrics
from ..priority_bands import openai_tier
from ..runtime import Runtime
from ..schemas import ChatBody, CompletionsBody, OpenAIBody, RequestLimits
from ..wire import (
    CHAT,
    COMPLETION,
    ChoiceShape,
    Encoder,
    OpenAIChunks,
    choices_usage,
    tool_message,
    whole_answer,
)
from .openai_errors import (
    OpenAIError,
    ServedModels,
    openai_error_envelope,
    openai_error_for,
    refuse_effort_the_template_reads,
)
from .pipeline import Adapter, Call, Collected, Pipeline, Prompt, Terms, answer_owned, refusals
from .serving import json_response


class CompletionsAdapter(Adapter[OpenAIBody]):
    """``/v1/completions``'s part of the pipeline: a prompt, continued."""

    shape: ChoiceShape = COMPLETION

    def __init__(self, runtime: Runtime, models: ServedModels) -> None:
        self.runtime = runtime
        self.models = models

    def parse(self, raw: bytes, limits: RequestLimits) -> OpenAIBody:
        return CompletionsBody.model_validate_json(raw, context=limits)

    def model(self, body: OpenAIBody) -> str:
        return self.models.check(body.model)

    async def prompt(self, runtime: Runtime, body: OpenAIBody) -> Prompt:
        """The body's prompt as it is (encoded in ``Runtime.prepare``). No checkpoint."""
        assert isinstance(body, CompletionsBody)
        return Prompt(body.prompt)

    def terms(self, body: OpenAIBody) -> Terms:
        return Terms(body.deadline_ms, new_tokens_field="max_tokens",
                     constraint_param=body.constraint_param)

    def field_error(self, error: ApiError, param: str) -> ApiError:
        return OpenAIError(error, param=param)

    def tools(self, body: OpenAIBody) -> str | None:
        """The tool format the answer is in (a chat's, with tools), or None."""
        return None

    async def answer(self, call: Call[OpenAIBody]) -> Response:
        """Open the stream (a stream a choice, ``choices.py``) and answer it as chunks or
        as one document (``tools``: in the tool format it is in).

        Cancellation: closed by its owner: the connection takes every stream as it opens
        (``pipeline.answer_owned``), with no checkpoint before.
        """
        body = call.body
        tools = self.tools(body)
        tier = openai_tier(call.prepared.request.priority)
        return await answer_owned(
            call, lambda streams: ChoicesAnswer(self.shape, body, call.model, streams,
                                                tools=tools, service_tier=tier),
            streaming=body.is_streaming, choices=body.choices)


class ChatAdapter(CompletionsAdapter):
    """``/v1/chat/completions``'s part: messages, rendered by the model's chat template,
    answered by the assistant."""

    shape = CHAT

    def parse(self, raw: bytes, limits: RequestLimits) -> OpenAIBody:
        return ChatBody.model_validate_json(raw, context=limits)

    async def prompt(self, runtime: Runtime, body: OpenAIBody) -> Prompt:
        """Cancellation: nothing to undo: nothing is opened here; a render and encode
        in flight is finished first (milliseconds), then the cancel lands."""
        assert isinstance(body, ChatBody)
        body.speak_tools_of(runtime.engine)  # its template's tool format, if any
        text, ids = await runtime.render_chat(body.template_input(),
                                              body.add_generation_prompt, key_name(),
                                              body.template_tools())
        self.refuse_unused_field(body)
        return Prompt(text, ids)

    def terms(self, body: OpenAIBody) -> Terms:
        assert isinstance(body, ChatBody)
        return Terms(body.deadline_ms, new_tokens_field=body.new_tokens_field(),
                     constraint_param=body.constraint_param)

    def tools(self, body: OpenAIBody) -> str | None:
        assert isinstance(body, ChatBody)
        return body.tool_format()

    def refuse_unused_field(self, body: ChatBody) -> None:
        """``reasoning_effort``: refused only where the template reads it. Sync."""
        refuse_effort_the_template_reads(self.runtime.engine, body.reasoning_effort,
                                         "reasoning_effort")


class ChoicesAnswer:
    """The chunks of one request's streams (a stream a choice), or its whole answer."""

    def __init__(self, shape: ChoiceShape, body: OpenAIBody, model: str,
                 streams: list[TokenStream], *, tools: str | None,
                 service_tier: str | None = None) -> None:
        self.shape = shape
        self.service_tier = service_tier  # the tier that served it: every object says it
        self.body = body
        self.model = model
        self.streams = streams
        self.tools = tools

    def headers(self) -> dict[str, str]:
        return {}

    def encoder(self) -> Encoder[Any]:
        first = self.streams[0].request_id
        choices = [s.request_id for s in self.streams] if len(self.streams) > 1 else None
        return OpenAIChunks(self.shape, first, self.model,
                            error_envelope=openai_error_envelope,
                            include_usage=self.body.include_usage, tools=self.tools,
                            choices=choices, service_tier=self.service_tier)

    async def whole(self, results: list[Collected]) -> dict[str, Any]:
        """One document; with several choices, one choice each and their usage summed.
        Cancellation: nothing to undo, as none can land: no checkpoint (the streams are
        closed by their owner, the connection)."""
        first = self.streams[0].request_id
        text, tokens, finish = results[0]
        answer = whole_answer(self.shape, first, self.model, text, finish, tokens)
        if self.service_tier is not None:
            answer["service_tier"] = self.service_tier
        if len(results) == 1:
            if self.tools:
                with_tool_calls(answer["choices"][0], first, text, self.tools)
            return answer
        choices = []
        for index, (text, tokens, finish) in enumerate(results):
            choice = whole_answer(self.shape, first, self.model, text, finish,
                                  tokens)["choices"][0]
            choice["index"] = index
            if self.tools:
                with_tool_calls(choice, self.streams[index].request_id, text, self.tools)
            choices.append(choice)
        answer["choices"] = choices
        answer["usage"] = choices_usage([finish for _, _, finish in results])
        return answer


def with_tool_calls(choice: dict[str, Any], request_id: str, text: str,
                    tools: str = "generic") -> None:
    """A chat choice whose answer is in the tool format ``tools``, as OpenAI's message:
    its tool calls, and ``tool_calls`` as its finish reason if it made any (and was not
    cut short)."""
    choice["message"], called = tool_message(request_id, text, tools)
    choice["logprobs"] = None
    if called and choice["finish_reason"] != "length":
        choice["finish_reason"] = "tool_calls"


class OpenAIViews:
    """The views that open nothing: the served models."""

    def __init__(self, models: ServedModels) -> None:
        self.models = models

    async def list_models(self) -> Response:
        """The served model and its alias. Cancellation: nothing to undo, as none can
        land: no checkpoint."""
        return json_response(self.models.listing())

    async def retrieve_model(self, model_id: str) -> Response:
        """One model's card, or 404 model_not_found. Cancellation: nothing to undo, as none
        can land: no checkpoint."""
        return json_response(self.models.card(self.models.check(model_id)))


def make_openai_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """The OpenAI routes, bound to one app's runtime; each request reports to ``metrics``."""
    bp = Blueprint("openai", __name__)
    settings = runtime.settings
    models = ServedModels(settings.model, settings.model_name, created=int(time.time()))
    views = OpenAIViews(models)
    pipeline = Pipeline(runtime, metrics)
    bp.add_url_rule("/v1/models", view_func=views.list_models, methods=["GET"])
    bp.add_url_rule("/v1/models/<path:model_id>", view_func=views.retrieve_model,
                    methods=["GET"])
    bp.add_url_rule("/v1/completions", "completions",
                    pipeline.view(CompletionsAdapter(runtime, models)), methods=["POST"])
    bp.add_url_rule("/v1/chat/completions", "chat_completions",
                    pipeline.view(ChatAdapter(runtime, models)), methods=["POST"])
    bp.register_error_handler(Exception, refusals(metrics, openai_error_for))
    # A wrong method, an unknown path below these, a 401 there: OpenAI's shape.
    bp.record_once(lambda state: answer_openai_errors(state.app))  # type: ignore[arg-type]
    return bp


def answer_openai_errors(app: Quart) -> None:
    for prefix in ("/v1/models", "/v1/completions", "/v1/chat/completions"):
        answer_errors_under(app, prefix, openai_error_for)
