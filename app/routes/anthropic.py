"""The Anthropic Messages routes: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A blueprint of its own, like the OpenAI routes (``openai.py``), so that its error
handler answers every refusal of these routes in Anthropic's shape and status
(``anthropic_errors.AnthropicError``), the API key's 401 included (``x-api-key`` or
bearer, ``app/auth.py``). A request is read and validated (``app.schemas``: text
turns only; anything else is refused naming the field), its ``model`` checked against
the served names (``openai_errors.ServedModels``, the same names), the conversation
rendered by the model's own chat template and encoded in one call
(``Runtime.render_chat``, as for ``/v1/chat/completions``), and then it runs exactly
like every other route, through the one pipeline (``pipeline.py``, with
``MessagesAdapter``): ``Runtime.prepare``, ``serving.open_owned``, the same closer,
timer, slow-reader
policy and disconnect path (``docs/cancellation.md``); only the bytes differ
(``app.wire``: ``AnthropicEvents``, ``whole_message``).

With ``tools`` the answer is constrained to the generic tool format
(``app.schemas.tools``; the constraint compiled in ``Runtime.prepare``, a 400
``invalid_request_error`` before the first byte if it does not compile) and sent as
``tool_use`` blocks (``AnthropicEvents(tools=True)``, ``whole_message(tools=True)``).
With ``output_config.format`` (structured output, ``app.schemas.anthropic_output``) the
answer is a JSON document of its schema, in one text block, constrained the same way.

``count_tokens`` renders and encodes the same way and answers the prompt's length; it
opens nothing (the prepared request is dropped unsubmitted).

Every other answer under ``/v1/messages`` (a wrong method's 405, an unknown path's 404,
the API key's 401 there) is in Anthropic's shape as well (``answer_errors_under``).
"""

from __future__ import annotations

import time
from typing import Any

from quart import Blueprint, Response

from streams import TokenStream

from ..auth import key_name
from ..error_handlers import answer_errors_under
from ..errors import ApiError
from ..metrics import Metrics
from ..priority_bands import anthropic_tier
from ..runtime import Runtime
from ..schemas import CountTokensBody, MessagesBody, RequestLimits
from ..wire import AnthropicEvents, Encoder, whole_message
from .anthropic_errors import anthropic_error_envelope, anthropic_error_for
from .openai_errors import ServedModels
from .pipeline import Adapter, Call, Collected, Pipeline, Prompt, Terms, answer_owned, refusals
from .serving import json_response, read_body

MESSAGES_PATH = "/v1/messages"


class MessagesAdapter(Adapter[MessagesBody]):
    """``/v1/messages``'s part of the pipeline: the conversation, answered by the
    assistant, as a stream of events or a message."""

    def __init__(self, models: ServedModels) -> None:
        self.models = models

    def parse(self, raw: bytes, limits: RequestLimits) -> MessagesBody:
        return MessagesBody.model_validate_json(raw, context=limits)

    def model(self, body: MessagesBody) -> str:
        return self.models.check(body.model)

    async def prompt(self, runtime: Runtime, body: MessagesBody) -> Prompt:
        """Cancellation: nothing to undo: nothing is opened here; a render and encode
        in flight is finished first (milliseconds), then the cancel lands."""
        body.speak_tools_of(runtime.engine)  # its template's tool format, if any
        text, ids = await runtime.render_chat(body.template_input(), True, key_name(),
                                              body.template_tools())
        return Prompt(text, ids)

    def terms(self, body: MessagesBody) -> Terms:
        """The server's deadline only; tools or ``output_config.format`` constrain a
        message."""
        return Terms(new_tokens_field="max_tokens", constraint_param=body.constraint_param)

    def field_error(self, error: ApiError, param: str) -> ApiError:
        """Anthropic's error names no field: its message does."""
        return ApiError(error.type, f"{param}: {error.message}",
                        retry_after_s=error.retry_after_s, allow=error.allow)

    async def answer(self, call: Call[MessagesBody]) -> Response:
        """Cancellation: closed by its owner (``pipeline.answer_owned``): a whole
        answer's at the stream's receive (``with source`` closes it), a streaming one's
        in the body, or the connection's backstop, closes it."""
        return await answer_owned(
            call, lambda streams: MessageAnswer(
                call.body, call.model, streams[0],
                anthropic_tier(call.prepared.request.priority)),
            streaming=call.body.is_streaming)


class MessageAnswer:
    """One stream's Anthropic events, or its message."""

    def __init__(self, body: MessagesBody, model: str, stream: TokenStream,
                 service_tier: str | None = None) -> None:
        self.tools = body.tool_format()
        self.service_tier = service_tier  # the tier that served it, in the usage
        self.model = model
        self.stream = stream

    def headers(self) -> dict[str, str]:
        return {"request-id": self.stream.request_id}

    def encoder(self) -> Encoder[Any]:
        return AnthropicEvents(self.stream.request_id, self.model, self.stream.prompt_tokens,
                               error_envelope=anthropic_error_envelope, tools=self.tools,
                               service_tier=self.service_tier)

    async def whole(self, results: list[Collected]) -> dict[str, Any]:
        """Cancellation: nothing to undo, as none can land: no checkpoint."""
        text, _, finish = results[0]
        return whole_message(self.stream.request_id, self.model, text, finish,
                             tools=self.tools, service_tier=self.service_tier)


class AnthropicViews:
    """``count_tokens``, bound to one app's runtime."""

    def __init__(self, runtime: Runtime, models: ServedModels) -> None:
        self.runtime = runtime
        self.limits = RequestLimits.from_settings(runtime.settings)
        self.models = models

    async def count_tokens(self) -> Response:
        """``{"input_tokens": n}``: the rendered conversation's length in tokens.

        Cancellation: nothing to undo: nothing is opened; a cancel while reading lands at
        once, and a render in flight is finished first (milliseconds).
        """
        body = CountTokensBody.model_validate_json(await read_body(), context=self.limits)
        self.models.check(body.model)
        body.speak_tools_of(self.runtime.engine)
        _, ids = await self.runtime.render_chat(body.template_input(), True, key_name(),
                                                body.template_tools())
        return json_response({"input_tokens": len(ids)})


def make_anthropic_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """The Anthropic routes, bound to one app's runtime; each request reports to ``metrics``."""
    bp = Blueprint("anthropic", __name__)
    settings = runtime.settings
    models = ServedModels(settings.model, settings.model_name, created=int(time.time()))
    views = AnthropicViews(runtime, models)
    bp.add_url_rule(MESSAGES_PATH, "messages",
                    Pipeline(runtime, metrics).view(MessagesAdapter(models)), methods=["POST"])
    bp.add_url_rule(f"{MESSAGES_PATH}/count_tokens", view_func=views.count_tokens,
                    methods=["POST"])
    bp.register_error_handler(Exception, refusals(metrics, anthropic_error_for))
    # A wrong method, an unknown path below /v1/messages, a 401 there: Anthropic's shape.
    bp.record_once(lambda state: answer_errors_under(state.app, MESSAGES_PATH,  # type: ignore[arg-type]
                                                      anthropic_error_for))
    return bp
