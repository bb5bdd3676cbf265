"""The OpenAI Responses API: ``POST /v1/responses`` and its stored responses.

A blueprint of its own whose every refusal is OpenAI's error object
(``openai_errors.OpenAIError``), as on the chat route. A request is validated
(``app.schemas.responses``), its conversation put together (``instructions`` as the
system turn, a ``previous_response_id``'s stored context and output, then its input
items: ``template_messages``), rendered by the model's chat template and encoded in one
call (``Runtime.render_chat``, then ``prepare``), exactly as ``/v1/chat/completions`` does:
the one pipeline (``pipeline.py``) with ``ResponsesAdapter``. Then:

* foreground (the default): the stream is the connection's (``close_with_connection``),
  as every stream here: a client that disconnects cancels it, promptly and exactly once
  (``docs/cancellation.md``). Streamed (``stream: true``) through the one SSE body with
  the Responses events (``app.wire.responses_events``), or answered whole as the
  response object;
* background: the resume registry's (``responses_background.py``); a disconnect
  cancels nothing.

With ``store`` (the default) the response is stored before the stream opens (the key's
bounds refuse it before the first byte, 429 ``too_many_stored``) and again, final, as its
last event goes out (``StoreWriter``; a client that left: ``cancelled``), for
``GET /v1/responses/<id>`` and the next turn (``responses_stored.py``).
"""

from __future__ import annotations

import time
from typing import Any, cast

from pydantic_core import PydanticCustomError
from quart import Blueprint, Quart, Response, current_app, g, request
from quart_trio import QuartTrio

from streams import TokenStream

from ..auth import key_name
from ..edge.connection import close_with_connection
from ..error_handlers import answer_errors_under
from ..errors import ApiError, ErrorType
from ..metrics import Metrics
from ..priority_bands import openai_tier
from ..runtime import (
    OutputParsing,
    ResponsesFull,
    ResponseStore,
    ResponseStoreUnavailable,
    Runtime,
    StoredResponse,
    response_store,
)
from ..schemas import RequestLimits, ResponsesBody
from ..wire import Encoder
from .openai_errors import (
    OpenAIError,
    ServedModels,
    openai_error_for,
    refuse_effort_the_template_reads,
)
from .pipeline import Adapter, Call, Collected, Pipeline, Prompt, Terms, answer_owned, refusals
from .responses_background import StoreWriter, start_background
from .responses_objects import (
    FINAL,
    NO_EVENTS,
    events_of,
    new_response,
    response_id_of,
    with_ids,
)
from .responses_stored import StoredResponses, unavailable

SERVER_OWNER = "(server)"  # what stored responses are counted under without API keys


class Settle:
    """A foreground response's final document, written once: at its last event (the
    encoder's ``on_final``), or, when its request ends without one (the client left),
    as ``cancelled``. The connection owns it (``close``)."""

    def __init__(self, writer: StoreWriter | None, document: StoredResponse) -> None:
        self.writer = writer
        self.document = document
        self.events = events_of(document, on_final=self.final)

    def final(self, response: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write(self.document.with_response(response))

    def whole(self, items: list[Any]) -> dict[str, Any]:
        """A whole answer's response object, final; its caller stores it (awaited: the
        next turn may follow at once), so nothing is written from here."""
        self.writer = None
        self.events.skip_through = NO_EVENTS  # the object only: nobody reads the events
        self.events.opening()
        self.events.encode(items)
        return self.events.response

    def close(self) -> None:
        """Sync, never a checkpoint (the connection's close)."""
        if not self.events.is_final and self.events.response["status"] not in FINAL:
            self.events.response["status"] = "cancelled"
            self.events.is_final = True
            self.final(self.events.snapshot())


class ResponsesAdapter(Adapter[ResponsesBody]):
    """``POST /v1/responses``'s part of the pipeline (see the module docstring), bound to
    one app's runtime and response store."""

    def __init__(self, runtime: Runtime, store: ResponseStore, models: ServedModels) -> None:
        self.runtime = runtime
        self.store = store
        self.models = models
        self.limits = RequestLimits.from_settings(runtime.settings)
        self._writer: StoreWriter | None = None

    def writer(self) -> StoreWriter:
        if self._writer is None:  # the app's nursery exists once it serves
            app = cast("QuartTrio", current_app)
            self._writer = StoreWriter(self.store, app.nursery)
        return self._writer

    def stored(self) -> StoredResponses:
        return StoredResponses(self.runtime, self.store, self.writer())

    def parse(self, raw: bytes, limits: RequestLimits) -> ResponsesBody:
        return ResponsesBody.model_validate_json(raw, context=limits)

    def model(self, body: ResponsesBody) -> str:
        return self.models.check(body.model)

    async def prompt(self, runtime: Runtime, body: ResponsesBody) -> Prompt:
        """The conversation put together (a ``previous_response_id``'s stored context and
        output, then this input) and rendered; its items kept as the prompt's context.

        Cancellation: nothing to undo: nothing is open while the previous response is
        read (abandoned, with a shared store) or the template renders (finished first,
        milliseconds)."""
        context = body.input_items()
        if body.previous_response_id is not None:
            context = [*await self.stored().previous(body.previous_response_id), *context]
            try:  # the stored turns count too, before the template renders them all
                body.check_conversation(context, self.limits)
            except PydanticCustomError as exc:
                raise OpenAIError(ApiError(
                    ErrorType.INVALID_REQUEST, f"the conversation (previous_response_id's "
                    f"turns and this input): {exc}"), param="input") from None
        body.speak_tools_of(runtime.engine)  # its template's tool format, if any
        text, ids = await runtime.render_chat(body.prompt_turns(context), True, key_name(),
                                              body.template_tools())
        effort = body.reasoning.effort if body.reasoning is not None else None
        refuse_effort_the_template_reads(runtime.engine, effort, "reasoning.effort")
        return Prompt(text, ids, tuple(context))

    def terms(self, body: ResponsesBody) -> Terms:
        return Terms(body.deadline_ms, new_tokens_field="max_output_tokens",
                     constraint_param=body.constraint_param,
                     registry_owned=bool(body.background))

    def field_error(self, error: ApiError, param: str) -> ApiError:
        return OpenAIError(error, param=param)

    async def answer(self, call: Call[ResponsesBody]) -> Response:
        """Store the response as created, then open it: the connection its owner
        (foreground), or the registry (background).

        Cancellation: nothing to undo while the document is stored, as nothing is open (a
        stored ``queued`` document, never answered, expires with the store's ``ttl_s``);
        after the open, a foreground response is closed by its owner, the connection,
        which also settles its document; a background one is handed over.
        """
        body = call.body
        request_id = call.prepared.request.request_id
        response_id = response_id_of(request_id)
        g.response_id = response_id  # named in the answer's head (name_the_response)
        created = new_response(response_id, body, call.model, created_at=int(time.time()),
                               max_output_tokens=body.new_tokens(),
                               service_tier=openai_tier(call.prepared.request.priority))
        items = body.input_items()
        document = StoredResponse(
            created=created, response=created,
            input_items=tuple(with_ids(response_id, items)), context=call.prompt.context,
            owner=key_name() or SERVER_OWNER,
            parser=output_parsing(body, request_id))
        if document.is_stored:
            await self._store(document)
        if body.background:
            return await start_background(self.runtime, self.writer(), call.prepared,
                                          call.spec, document, call.timer,
                                          stream=bool(body.stream))
        writer = self.writer() if document.is_stored else None
        return await answer_owned(
            call, lambda streams: ForegroundAnswer(self, writer, document, streams[0]),
            streaming=bool(body.stream),
            not_opened=None if writer is None else lambda: writer.forget(document))

    async def _store(self, document: StoredResponse) -> None:
        """Raises: OpenAIError 429 too_many_stored; ApiError 503. Cancellation: abandoned,
        with a shared store (one atomic write: it lands whole or not)."""
        try:
            await self.store.put(document)
        except ResponsesFull as exc:
            raise OpenAIError(ApiError(ErrorType.TOO_MANY_STORED, str(exc)),
                              param="store") from None
        except ResponseStoreUnavailable:
            raise unavailable() from None


def output_parsing(body: ResponsesBody, request_id: str) -> OutputParsing:
    """How the response's text becomes its output, kept in its record so that every
    reader parses it alike: function calls in the request's tool format (the template's
    own, or the generic one), else text."""
    call_format = body.tool_format()
    if call_format is None:
        return OutputParsing(logprobs=body.wants_logprobs)
    return OutputParsing(logprobs=body.wants_logprobs, call_prefix=f"call_{request_id}",
                         call_format=call_format)


class ForegroundAnswer:
    """A foreground response's events, or its whole response object (stored before it
    is answered: the next turn may follow at once). Made right after the open: the
    connection owns its ``Settle`` from then on."""

    def __init__(self, adapter: ResponsesAdapter, writer: StoreWriter | None,
                 document: StoredResponse, stream: TokenStream) -> None:
        self.adapter = adapter
        self.writer = writer
        self.document = document
        self.settle = Settle(writer, document)
        close_with_connection(request.scope, self.settle)

    def headers(self) -> dict[str, str]:
        return {}

    def encoder(self) -> Encoder[Any]:
        return self.settle.events

    async def whole(self, results: list[Collected]) -> dict[str, Any]:
        """Cancellation: abandoned, with a shared store, while the final document is
        stored (one atomic write: it lands whole or not); the stream is closed already."""
        _, tokens, finish = results[0]
        response = self.settle.whole([*tokens, finish])
        if self.writer is not None:  # the next turn may follow at once: stored before
            await self.adapter._store(self.document.with_response(response))
        return response


class ResponsesViews:
    """The stored responses' views, bound to one app's adapter."""

    def __init__(self, adapter: ResponsesAdapter) -> None:
        self.adapter = adapter

    async def retrieve(self, response_id: str) -> Response:
        """Cancellation: ``StoredResponses.retrieve``'s: nothing to undo, or handed
        over."""
        return await self.adapter.stored().retrieve(response_id)

    async def input_items(self, response_id: str) -> Response:
        """Cancellation: nothing to undo: a read."""
        return await self.adapter.stored().input_items(response_id)

    async def delete(self, response_id: str) -> Response:
        """Cancellation: ``StoredResponses.delete``'s: abandoned, atomic calls."""
        return await self.adapter.stored().delete(response_id)

    async def cancel(self, response_id: str) -> Response:
        """Cancellation: ``StoredResponses.cancel``'s: abandoned, atomic calls."""
        return await self.adapter.stored().cancel(response_id)


# The header that names a created response (a proxy's stick table stores it).
RESPONSE_ID_HEADER = "Streamscope-Response-Id"


def make_responses_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """The Responses API's routes, bound to one app's runtime."""
    bp = Blueprint("responses", __name__)
    settings = runtime.settings
    models = ServedModels(settings.model, settings.model_name, created=int(time.time()))
    adapter = ResponsesAdapter(runtime, response_store(settings, runtime.shared_store), models)
    views = ResponsesViews(adapter)
    bp.add_url_rule("/v1/responses", "create", Pipeline(runtime, metrics).view(adapter),
                    methods=["POST"])
    bp.add_url_rule("/v1/responses/<response_id>", view_func=views.retrieve, methods=["GET"])
    bp.add_url_rule("/v1/responses/<response_id>", view_func=views.delete,
                    methods=["DELETE"])
    bp.add_url_rule("/v1/responses/<response_id>/input_items", view_func=views.input_items,
                    methods=["GET"])
    bp.add_url_rule("/v1/responses/<response_id>/cancel", view_func=views.cancel,
                    methods=["POST"])
    bp.after_request(name_the_response)
    bp.register_error_handler(Exception, refusals(metrics, openai_error_for))
    # A wrong method, an unknown path below these, a 401 there: OpenAI's shape.
    bp.record_once(lambda state: answer_responses_errors(state.app))  # type: ignore[arg-type]
    return bp


async def name_the_response(response: Response) -> Response:
    """A created response's id in a header of the answer's head, whether it streams or
    not: a proxy learns where a conversation's turn was made (deploy/haproxy.cfg sticks
    the next turn, its ``previous_response_id``, to that replica). Cancellation: nothing
    to undo, as none can land: no checkpoint."""
    response_id = g.get("response_id")
    if response_id is not None and response.status_code == 200:
        response.headers[RESPONSE_ID_HEADER] = response_id
    return response


def answer_responses_errors(app: Quart) -> None:
    answer_errors_under(app, "/v1/responses", openai_error_for)
