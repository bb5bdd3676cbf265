"""The OpenAI-compatible routes: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

A blueprint of its own, so that its error handler answers every refusal of these routes
in OpenAI's shape (``openai_compat.OpenAIError``), the API key's 401 included; the other
routes keep our envelope. A request is read and validated (``openai_schemas.py``), its
``model`` checked, chat messages rendered by the model's own chat template (in a worker
thread, by the engine: ``Runtime.render_chat``), and then it runs exactly like
``/v1/stream`` or ``/v1/generate``: the same ``serving.open_owned_stream``, owner, timer
and disconnect path (``docs/cancellation.md`` walks through it); only the body's bytes differ.
"""

from __future__ import annotations

import time

from quart import Blueprint, Response

from engine import GenerationRequest

from .lifespan import Runtime
from .metrics import Metrics, RequestTimer
from .openai_compat import (
    CHAT,
    COMPLETION,
    ChoiceShape,
    OpenAIChunksBody,
    ServedModels,
    openai_error_for,
    whole_answer,
)
from .openai_schemas import ChatBody, CompletionsBody, OpenAIBody
from .schemas import RequestLimits
from .serving import (
    collect,
    json_response,
    open_owned_stream,
    read_body,
    sse_response,
    ttft_deadline,
)


def make_openai_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """The OpenAI routes, bound to one app's runtime; each request reports to ``metrics``."""
    bp = Blueprint("openai", __name__)
    settings = runtime.settings
    limits = RequestLimits.from_settings(settings)
    models = ServedModels(settings.model, settings.model_name, created=int(time.time()))

    def deadline_of(timer: RequestTimer, body: OpenAIBody) -> float | None:
        return ttft_deadline(timer, body.deadline_ms, settings.ttft_deadline_ms)

    async def answer(
        timer: RequestTimer,
        body: OpenAIBody,
        generation: GenerationRequest,
        model: str,
        shape: ChoiceShape,
    ) -> Response:
        """Open the stream and answer it as chunks or as one document.

        Cancellation: before the stream opens (queued for or in the prompt's encode),
        nothing to undo; after, the body, ``with stream`` or the connection's backstop
        closes it.
        """
        stream = await open_owned_stream(runtime, generation, None, timer)
        if body.is_streaming:
            chunks = OpenAIChunksBody(
                stream, keepalive_s=settings.keepalive_s, shape=shape, model=model,
                include_usage=body.include_usage, timer=timer,
            )
            return sse_response(chunks, stream.request_id)
        with stream:
            text, _, finish = await collect(stream, timer)
        return json_response(
            whole_answer(shape, stream.request_id, model, text, finish),
            headers={"X-Request-ID": stream.request_id},
        )

    @bp.get("/v1/models")
    async def list_models() -> Response:
        """The served model and its alias. Cancellation: no checkpoint."""
        return json_response(models.listing())

    @bp.get("/v1/models/<path:model_id>")
    async def retrieve_model(model_id: str) -> Response:
        """One model's card, or 404 model_not_found. Cancellation: no checkpoint."""
        models.check(model_id)
        return json_response(models.card(model_id))

    @bp.post("/v1/completions")
    async def completions() -> Response:
        """A prompt, continued. Cancellation: see ``answer``."""
        timer = metrics.start_request()
        body = CompletionsBody.model_validate_json(await read_body(), context=limits)
        model = models.check(body.model)
        generation = body.generation_request(body.prompt, limits,
                                             ttft_deadline=deadline_of(timer, body))
        return await answer(timer, body, generation, model, COMPLETION)

    @bp.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        """Messages, rendered by the model's chat template, answered by the assistant.

        Cancellation: while the template renders (never abandoned; milliseconds),
        nothing was made; then see ``answer``.
        """
        timer = metrics.start_request()
        body = ChatBody.model_validate_json(await read_body(), context=limits)
        model = models.check(body.model)
        text, prompt_ids = await runtime.render_chat(
            body.template_input(), body.add_generation_prompt
        )
        generation = body.generation_request(text, limits, prompt_ids,
                                             ttft_deadline=deadline_of(timer, body))
        return await answer(timer, body, generation, model, CHAT)

    async def refuse(exc: Exception) -> Response:
        """Every error of these routes, in OpenAI's shape. Cancellation: no checkpoint."""
        error = openai_error_for(exc)
        metrics.refused(error)
        return error.to_response()

    bp.register_error_handler(Exception, refuse)
    return bp
