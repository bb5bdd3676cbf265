"""The OpenAI Responses API: ``POST /v1/responses`` and its stored responses.

A blueprint of its own whose every refusal is OpenAI's error object
(``openai_errors.OpenAIError``), as on the chat route. A request is validated
(``app.schemas.responses``), its conversation put together (``instructions`` as the
system turn, a ``previous_response_id``'s stored context and output, then its input
items: ``template_messages``), rendered by the model's chat template and encoded in one
call (``Runtime.render_chat``, then ``prepare``), exactly as ``/v1/chat/completions`` does. Then:

* foreground (the default): the stream is the connection's (``own``), as every stream
  here: a client that disconnects cancels it, promptly and exactly once
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
import uuid
from typing import Any, cast

from pydantic_core import PydanticCustomError
from quart import Blueprint, Quart, Response, current_app, g, request
from quart_trio import QuartTrio

from engine import GenerationRequest, InvalidConstraint, SamplingParams
from streams.resume import spec_of, with_seed

from ..auth import key_name, owned_request
from ..edge.connection import own
from ..error_handlers import answer_errors_under, error_response
from ..errors import ApiError, ErrorType
from ..metrics import Metrics
from ..runtime import (
    OutputParsing,
    Prepared,
    ResponsesFull,
    ResponseStore,
    ResponseStoreUnavailable,
    Runtime,
    StoredResponse,
    response_store,
)
from ..schemas import RequestLimits
from ..schemas.responses import ResponsesBody
from .body import EventStreamBody
from .openai_errors import OpenAIError, ServedModels, openai_error_for
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
from .serving import (
    collect,
    json_response,
    open_owned,
    read_body,
    sse_response,
    ttft_deadline,
)

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


class ResponsesViews:
    """``POST /v1/responses``, bound to one app's runtime and response store."""

    def __init__(self, runtime: Runtime, metrics: Metrics, store: ResponseStore) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.store = store
        settings = runtime.settings
        self.limits = RequestLimits.from_settings(settings)
        self.models = ServedModels(settings.model, settings.model_name, created=int(time.time()))
        self._writer: StoreWriter | None = None

    def writer(self) -> StoreWriter:
        if self._writer is None:  # the app's nursery exists once it serves
            app = cast("QuartTrio", current_app)
            self._writer = StoreWriter(self.store, app.nursery)
        return self._writer

    def stored(self) -> StoredResponses:
        return StoredResponses(self.runtime, self.store, self.writer())

    async def create(self) -> Response:
        """Make a response (see the module docstring).

        Cancellation: while the previous response is read, the template renders, the
        document is stored: nothing is open (a stored ``queued`` document is left to
        expire); after the open, as ``/v1/chat/completions`` (foreground) or as a
        resumable stream (background).
        """
        timer = self.metrics.start_request()
        body = ResponsesBody.model_validate_json(await read_body(), context=self.limits)
        model = self.models.check(body.model)
        items = body.input_items()
        context = items
        if body.previous_response_id is not None:
            context = [*await self.stored().previous(body.previous_response_id), *items]
            try:  # the stored turns count too, before the template renders them all
                body.check_conversation(context, self.limits)
            except PydanticCustomError as exc:
                raise OpenAIError(ApiError(
                    ErrorType.INVALID_REQUEST, f"the conversation (previous_response_id's "
                    f"turns and this input): {exc}"), param="input") from None
        constraint = body.constraint()
        new_tokens = body.new_tokens()
        shared = self.runtime.settings.resume_store is not None
        deadline = ttft_deadline(timer, body.deadline_ms, self.runtime.settings.ttft_deadline_ms)

        text, prompt_ids = await self.runtime.render_chat(body.prompt_turns(context), True,
                                                          key_name())
        generation = owned_request(GenerationRequest(
            request_id=uuid.uuid4().hex, prompt=text, max_new_tokens=new_tokens,
            sampling=SamplingParams(
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                logprobs=body.wants_logprobs, top_logprobs=body.top_logprobs or 0),
            prompt_token_ids=prompt_ids, ttft_deadline=deadline, constraint=constraint))
        if body.background and shared:
            generation = with_seed(generation)
        try:
            prepared = await self.runtime.prepare(generation, None,
                                                  new_tokens_field="max_output_tokens")
        except InvalidConstraint as exc:
            raise OpenAIError(ApiError(ErrorType.INVALID_CONSTRAINT, str(exc)),
                              param=body.constraint_param) from None
        request_id = prepared.request.request_id
        response_id = response_id_of(request_id)
        g.response_id = response_id  # named in the answer's head (name_the_response)
        created = new_response(response_id, body, model, created_at=int(time.time()),
                               max_output_tokens=new_tokens)
        document = StoredResponse(
            created=created, response=created,
            input_items=tuple(with_ids(response_id, items)), context=tuple(context),
            owner=key_name() or SERVER_OWNER,
            parser=OutputParsing(logprobs=body.wants_logprobs, call_prefix=(
                f"call_{request_id}" if body.tool_use() is not None else None)))
        if document.is_stored:
            await self._store(document)
        if body.background:
            spec = spec_of(prepared.request, None) if shared else None
            return await start_background(self.runtime, self.writer(), prepared, spec,
                                          document, timer, stream=bool(body.stream))
        return await self.foreground(prepared, document, timer, stream=bool(body.stream))

    async def foreground(self, prepared: Prepared, document: StoredResponse, timer: Any, *,
                         stream: bool) -> Response:
        """Open the stream, the connection its owner, and answer it as events or whole.

        Cancellation: a whole answer's at the stream's receive (``with opened`` closes
        it); a streaming one's in the body, or the connection's backstop, closes it.
        """
        writer = self.writer() if document.is_stored else None
        try:
            opened = open_owned(self.runtime, prepared, timer)
        except Exception:  # refused: no response was made
            if writer is not None:
                writer.forget(document)
            raise
        settle = Settle(writer, document)
        own(request.scope, settle)
        if stream:
            body = EventStreamBody(opened, settle.events,
                                   keepalive_s=self.runtime.settings.keepalive_s,
                                   keepalives=self.runtime.keepalives, timer=timer)
            return sse_response(body, opened.request_id)
        with opened:
            _, tokens, finish = await collect(opened, timer)
        response = settle.whole([*tokens, finish])
        if writer is not None:  # the next turn may follow at once: stored before answering
            await self._store(document.with_response(response))
        return json_response(response, headers={"X-Request-ID": opened.request_id})

    async def _store(self, document: StoredResponse) -> None:
        """Raises: OpenAIError 429 too_many_stored; ApiError 503. Cancellation: lands or not."""
        try:
            await self.store.put(document)
        except ResponsesFull as exc:
            raise OpenAIError(ApiError(ErrorType.TOO_MANY_STORED, str(exc)),
                              param="store") from None
        except ResponseStoreUnavailable:
            raise unavailable() from None

    async def retrieve(self, response_id: str) -> Response:
        """Cancellation: see ``StoredResponses.retrieve``."""
        return await self.stored().retrieve(response_id)

    async def input_items(self, response_id: str) -> Response:
        """Cancellation: a read."""
        return await self.stored().input_items(response_id)

    async def delete(self, response_id: str) -> Response:
        """Cancellation: see ``StoredResponses.delete``."""
        return await self.stored().delete(response_id)

    async def cancel(self, response_id: str) -> Response:
        """Cancellation: see ``StoredResponses.cancel``."""
        return await self.stored().cancel(response_id)

    async def refuse(self, exc: Exception) -> Response:
        """Every error of these routes, in OpenAI's shape. Cancellation: no checkpoint."""
        error = openai_error_for(exc)
        self.metrics.refused(error)
        return error_response(error)


# The header that names a created response (a proxy's stick table stores it).
RESPONSE_ID_HEADER = "Streamscope-Response-Id"


def make_responses_blueprint(runtime: Runtime, metrics: Metrics) -> Blueprint:
    """The Responses API's routes, bound to one app's runtime."""
    bp = Blueprint("responses", __name__)
    views = ResponsesViews(runtime, metrics,
                           response_store(runtime.settings, runtime.shared_store))
    bp.add_url_rule("/v1/responses", view_func=views.create, methods=["POST"])
    bp.add_url_rule("/v1/responses/<response_id>", view_func=views.retrieve, methods=["GET"])
    bp.add_url_rule("/v1/responses/<response_id>", view_func=views.delete,
                    methods=["DELETE"])
    bp.add_url_rule("/v1/responses/<response_id>/input_items", view_func=views.input_items,
                    methods=["GET"])
    bp.add_url_rule("/v1/responses/<response_id>/cancel", view_func=views.cancel,
                    methods=["POST"])
    bp.after_request(name_the_response)
    bp.register_error_handler(Exception, views.refuse)
    # A wrong method, an unknown path below these, a 401 there: OpenAI's shape.
    bp.record_once(lambda state: answer_responses_errors(state.app))  # type: ignore[arg-type]
    return bp


async def name_the_response(response: Response) -> Response:
    """A created response's id in a header of the answer's head, whether it streams or
    not: a proxy learns where a conversation's turn was made (deploy/haproxy.cfg sticks
    the next turn, its ``previous_response_id``, to that replica). Cancellation: no
    checkpoint."""
    response_id = g.get("response_id")
    if response_id is not None and response.status_code == 200:
        response.headers[RESPONSE_ID_HEADER] = response_id
    return response


def answer_responses_errors(app: Quart) -> None:
    answer_errors_under(app, "/v1/responses", openai_error_for)
