"""The Anthropic Messages routes: ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

A blueprint of its own, like the OpenAI routes (``openai.py``), so that its error
handler answers every refusal of these routes in Anthropic's shape and status
(``anthropic_errors.AnthropicError``), the API key's 401 included (``x-api-key`` or
bearer, ``app/auth.py``). A request is read and validated (``app.schemas``: text
turns only; anything else is refused naming the field), its ``model`` checked against
the served names (``openai_errors.ServedModels``, the same names), the conversation
rendered by the model's own chat template and encoded in one call
(``Runtime.render_chat``, as for ``/v1/chat/completions``), and then it runs exactly
like every other route: ``Runtime.prepare``, ``serving.open_owned``, the same closer,
timer, slow-reader
policy and disconnect path (``docs/cancellation.md``); only the bytes differ
(``app.wire``: ``AnthropicEvents``, ``whole_message``).

With ``tools`` the answer is constrained to the generic tool format
(``app.schemas.tools``; the constraint compiled in ``Runtime.prepare``, a 400
``invalid_request_error`` before the first byte if it does not compile) and sent as
``tool_use`` blocks (``AnthropicEvents(tools=True)``, ``whole_message(tools=True)``).

``count_tokens`` renders and encodes the same way and answers the prompt's length; it
opens nothing (the prepared request is dropped unsubmitted).

Every other answer under ``/v1/messages`` (a wrong method's 405, an unknown path's 404,
the API key's 401 there) is in Anthropic's shape as well (``answer_errors_under``).
"""

from __future__ import annotations

import time

from quart import Blueprint, Response

from engine import InvalidConstraint

from ..auth import key_name, owned_request
from ..error_handlers import answer_errors_under, error_response
from ..errors import ApiError, ErrorType
from ..metrics import Metrics
from ..runtime import Runtime
from ..schemas import CountTokensBody, MessagesBody, RequestLimits
from ..wire import AnthropicEvents, whole_message
from .anthropic_errors import anthropic_error_envelope, anthropic_error_for
from .body import EventStreamBody
from .openai_errors import ServedModels
from .serving import (
    collect,
    json_response,
    open_owned,
    read_body,
    sse_response,
    ttft_deadline,
)

MESSAGES_PATH = "/v1/messages"


class AnthropicViews:
    """The views, bound to one app's runtime; each request reports to ``metrics``."""

    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self.runtime = runtime
        self.metrics = metrics
        settings = runtime.settings
        self.limits = RequestLimits.from_settings(settings)
        self.models = ServedModels(settings.model, settings.model_name, created=int(time.time()))

    async def messages(self) -> Response:
        """The conversation, answered by the assistant: a stream of events or a message.

        Cancellation: before the stream opens (reading, rendering), nothing to undo;
        after, a whole answer's at the stream's receive (``with stream`` closes it), a
        streaming one's in the body, or the connection's backstop, closes it.
        """
        timer = self.metrics.start_request()
        body = MessagesBody.model_validate_json(await read_body(), context=self.limits)
        model = self.models.check(body.model)
        deadline = ttft_deadline(timer, None, self.runtime.settings.ttft_deadline_ms)

        body.speak_tools_of(self.runtime.engine)  # its template's tool format, if any
        text, prompt_ids = await self.runtime.render_chat(body.template_input(), True,
                                                          key_name(), body.template_tools())
        generation = body.generation_request(text, prompt_ids, ttft_deadline=deadline)
        try:
            prepared = await self.runtime.prepare(owned_request(generation), None,
                                                  new_tokens_field="max_tokens")
        except InvalidConstraint as exc:
            raise ApiError(ErrorType.INVALID_CONSTRAINT, f"tools: {exc}") from None
        tools = body.tool_format()
        stream = open_owned(self.runtime, prepared, timer)
        headers = {"request-id": stream.request_id}
        if body.is_streaming:
            events = AnthropicEvents(stream.request_id, model, stream.prompt_tokens,
                                     error_envelope=anthropic_error_envelope, tools=tools)
            return sse_response(
                EventStreamBody(stream, events, keepalive_s=self.runtime.settings.keepalive_s,
                                keepalives=self.runtime.keepalives, timer=timer),
                stream.request_id, headers=headers,
            )
        with stream:
            text, _, finish = await collect(stream, timer)
        return json_response(
            whole_message(stream.request_id, model, text, finish, tools=tools),
            headers={"X-Request-ID": stream.request_id, **headers},
        )

    async def count_tokens(self) -> Response:
        """``{"input_tokens": n}``: the rendered conversation's length in tokens.

        Cancellation: while reading or rendering (never abandoned; milliseconds);
        nothing is opened.
        """
        body = CountTokensBody.model_validate_json(await read_body(), context=self.limits)
        self.models.check(body.model)
        body.speak_tools_of(self.runtime.engine)
        _, ids = await self.runtime.render_chat(body.template_input(), True, key_name(),
                                                body.template_tools())
        return json_response({"input_tokens": len(ids)})

    async def refuse(self, exc: Exception) -> Response:
        """Every error of these routes, in Anthropic's shape. Cancellation: no checkpoint."""
        error = anthropic_error_for(exc)
        self.metrics.refused(error)
        return error_response(error)


def make_anthropic_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """The Anthropic routes, bound to one app's runtime; each request reports to ``metrics``."""
    bp = Blueprint("anthropic", __name__)
    views = AnthropicViews(runtime, metrics)
    bp.add_url_rule(MESSAGES_PATH, view_func=views.messages, methods=["POST"])
    bp.add_url_rule(f"{MESSAGES_PATH}/count_tokens", view_func=views.count_tokens,
                    methods=["POST"])
    bp.register_error_handler(Exception, views.refuse)
    # A wrong method, an unknown path below /v1/messages, a 401 there: Anthropic's shape.
    bp.record_once(lambda state: answer_errors_under(state.app, MESSAGES_PATH,  # type: ignore[arg-type]
                                                      anthropic_error_for))
    return bp
