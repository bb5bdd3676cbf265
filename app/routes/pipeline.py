"""One request pipeline for every API: the generic view, and what an API's adapter supplies.

Every route that generates runs the same steps (``Pipeline.serve``): the metrics timer
starts; the body is read (``serving.read_body``) and parsed; the ``model`` checked; the
prompt rendered (a chat template through ``Runtime.render_chat``, or the body's prompt as
it is); the engine's ``GenerationRequest`` built, due its first token by
``serving.ttft_deadline``, in its band (``Pipeline.banded``: ``app/priority_bands.py``),
under an id the request's API key owns (``auth.owned_request``); ``Runtime.prepare``
(refusals, deadline, encode; a constraint that does not compile is refused naming its
field, in the API's shape); then the stream opens and is answered. What differs from
one API to another is an ``Adapter``: how it parses its body, builds its request, names
its fields in refusals, and answers.

Opening, the two ways (``docs/cancellation.md`` walks both):

* connection-owned (``answer_owned``): ``serving.open_owned`` (``open_choices`` for
  OpenAI's ``n``) opens the stream and hands it to the request's connection with no
  checkpoint between; a client that disconnects cancels it. The answer is the SSE body
  (``body.EventStreamBody``) with the adapter's encoder, or the collected whole answer
  in the adapter's shape;
* registry-owned (``registry_owned.open_registry_owned``): resumable streams
  (``POST /v1/requests``, ``/v1/stream`` with ``resumable``) and background responses;
  the resume registry owns the stream from the moment it opens, and the request's
  connection only its first reader, if any. Such a request is prepared seeded, with its
  failover spec, when the store is shared (``Pipeline.prepare``).

Ownership: a view awaits ``Runtime.prepare``, then with no checkpoint between opens the
stream (``Runtime.open``) and hands it to its closer.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

from quart import Response, request

from engine import FinishEvent, GenerationRequest, InvalidConstraint, TokenEvent
from streams import PolicyName, TokenStream
from streams.resume import spec_of, with_seed

from ..auth import key_name, owned_request
from ..error_handlers import ErrorFor, error_response
from ..errors import ApiError, ErrorType
from ..metrics import Metrics, RequestTimer
from ..priority_bands import OBJECTIVE_HEADER, BandRules
from ..runtime import Prepared, Runtime
from ..schemas import RequestLimits
from ..wire import Encoder
from .body import EventStreamBody
from .choices import ChoicesSource, choices_prepared, collect_choices
from .serving import (
    collect,
    json_response,
    open_choices,
    open_owned,
    read_body,
    sse_response,
    ttft_deadline,
)

B = TypeVar("B", bound="RequestBody")

# One stream read to its end: its text, its token events, its finish.
Collected = tuple[str, list[TokenEvent], FinishEvent]


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt: its text and, when a chat template rendered it, its token
    ids (``Runtime.prepare`` keeps them); ``context``: the conversation it was rendered
    of, for an API that keeps it (the Responses API's stored responses)."""

    text: str
    ids: tuple[int, ...] | None = None
    context: tuple[dict[str, Any], ...] = ()


@dataclass(slots=True)
class Call(Generic[B]):
    """One request on its way through the pipeline, prepared, not yet opened.

    ``generation`` is the engine's request before ``auth.owned_request`` (more choices
    derive their ids from it, ``choices.choices_prepared``); ``spec`` the failover spec
    of a registry-owned stream with a shared store, else None."""

    runtime: Runtime
    timer: RequestTimer
    body: B
    model: str
    prompt: Prompt
    generation: GenerationRequest
    prepared: Prepared
    spec: bytes | None


class Answer(Protocol):
    """How one API answers a stream it opened: made right after the open (sync, no
    checkpoint), from the streams (one, or a stream per choice)."""

    def headers(self) -> dict[str, str]:
        """The answer's headers besides ``X-Request-ID``."""
        ...

    def encoder(self) -> Encoder[Any]:
        """The SSE body's encoder."""
        ...

    async def whole(self, results: list[Collected]) -> dict[str, Any]:
        """The whole answer's document, of each stream's result, in order."""
        ...


class RequestBody(Protocol):
    """Every API's body builds its engine request in one shape (``app.schemas``)."""

    def generation_request(
        self, prompt: str | None = None, prompt_ids: tuple[int, ...] | None = None, *,
        ttft_deadline: float | None = None,
    ) -> GenerationRequest: ...

    @property
    def asked_band(self) -> int | None:
        """The band its ``priority`` or ``service_tier`` asks for; None: neither."""
        ...


@dataclass(frozen=True, slots=True)
class Terms:
    """How the pipeline prepares one body's request: its ``deadline_ms`` (None: the
    server's default), its slow-reader ``policy``, the body's own names for the new tokens
    and for the field whose constraint a refusal names, and whether the resume registry
    is to own the stream (else the connection)."""

    deadline_ms: float | None = None
    policy: PolicyName | None = None
    new_tokens_field: str = "max_new_tokens"
    constraint_param: str = "constraint"
    registry_owned: bool = False


class Adapter(Generic[B]):
    """One API's part of the pipeline (the module docstring): a subclass parses its body
    (``parse``, raising what the API refuses a body with), renders its prompt and answers
    (``answer``: ``answer_owned``, or ``registry_owned.open_registry_owned``); the rest
    has defaults."""

    def parse(self, raw: bytes, limits: RequestLimits) -> B:
        raise NotImplementedError

    def model(self, body: B) -> str:
        """The served model's name the answer echoes (refusing one not served); the
        native API names none."""
        return ""

    async def prompt(self, runtime: Runtime, body: B) -> Prompt:
        """The rendered prompt. Cancellation: nothing to undo: nothing is opened; a
        render in flight is finished first (milliseconds)."""
        raise NotImplementedError

    def terms(self, body: B) -> Terms:
        return Terms()

    def field_error(self, error: ApiError, param: str) -> ApiError:
        """``error`` caused by the body's field ``param``, in the API's shape; our
        envelope names no field (the message says what is wrong)."""
        return error

    async def answer(self, call: Call[B]) -> Response:
        raise NotImplementedError


class Pipeline:
    """The generic view, bound to one app's runtime; each request reports to ``metrics``."""

    def __init__(self, runtime: Runtime, metrics: Metrics) -> None:
        self.runtime = runtime
        self.metrics = metrics
        self.limits = RequestLimits.from_settings(runtime.settings)
        settings = runtime.settings
        self.bands = BandRules.of(settings.priority_ceiling, settings.priority_ceilings,
                                  settings.inference_objectives)

    def view(self, adapter: Adapter[Any]) -> Callable[[], Awaitable[Response]]:
        """A view function that serves ``adapter``'s requests."""
        async def serve() -> Response:
            return await self.serve(adapter)
        return serve

    async def serve(self, adapter: Adapter[Any]) -> Response:
        """One request, every step (the module docstring).

        Cancellation: before the stream opens (reading, rendering, preparing), nothing
        to undo; after, see ``answer_owned`` or the registry-owned opener.
        """
        timer = self.metrics.start_request()
        body = adapter.parse(await read_body(), self.limits)
        model = adapter.model(body)
        prompt = await adapter.prompt(self.runtime, body)
        terms = adapter.terms(body)
        deadline = ttft_deadline(timer, terms.deadline_ms,
                                 self.runtime.settings.ttft_deadline_ms)
        generation = self.banded(
            body, body.generation_request(prompt.text, prompt.ids, ttft_deadline=deadline))
        prepared, spec = await self.prepare(adapter, terms, owned_request(generation))
        call = Call(self.runtime, timer, body, model, prompt, generation, prepared, spec)
        return await adapter.answer(call)

    def banded(self, body: RequestBody, generation: GenerationRequest) -> GenerationRequest:
        """``generation`` in the band it is served in: what the body asks for (else the
        gateway's objective header's band), no higher than its key's ceiling
        (``priority_bands``). The answer's ``service_tier`` says it."""
        band = self.bands.served(body.asked_band, request.headers.get(OBJECTIVE_HEADER),
                                 key_name())
        return replace(generation, priority=band)

    async def prepare(self, adapter: Adapter[Any], terms: Terms, generation: GenerationRequest
                      ) -> tuple[Prepared, bytes | None]:
        """The request prepared (``Runtime.prepare``) and, when the registry is to own
        it with a shared store, seeded, with its failover spec
        (``streams.resume.spec_of``); else None for the spec. A constraint that does not
        compile: the API's refusal naming its field.

        Cancellation: nothing to undo: nothing is opened before it returns (an encode
        or compile in flight is finished first: milliseconds, seconds for the very first
        compile)."""
        shared = terms.registry_owned and self.runtime.settings.resume_store is not None
        try:
            prepared = await self.runtime.prepare(
                with_seed(generation) if shared else generation, terms.policy,
                new_tokens_field=terms.new_tokens_field)
        except InvalidConstraint as exc:
            raise adapter.field_error(ApiError(ErrorType.INVALID_CONSTRAINT, str(exc)),
                                      terms.constraint_param) from None
        return prepared, spec_of(prepared.request, terms.policy) if shared else None


def refusals(metrics: Metrics, error_for: ErrorFor) -> Callable[[Exception], Awaitable[Response]]:
    """A blueprint's error handler: every error of its routes in its API's shape
    (``error_for``), counted as refused. Cancellation: nothing to undo, as none can
    land: no checkpoint."""
    async def refuse(exc: Exception) -> Response:
        error = error_for(exc)
        metrics.refused(error)
        return error_response(error)
    return refuse


async def answer_owned(
    call: Call[Any], answer_of: Callable[[list[TokenStream]], Answer], *, streaming: bool,
    choices: int = 1, not_opened: Callable[[], None] | None = None,
) -> Response:
    """Open the stream (a stream per choice with ``choices``, opened back to back: the
    prefix cache serves the prompt to all but the first), the connection its owner, and
    answer it as the SSE body of ``answer_of``'s encoder or as its whole answer.
    ``not_opened``: told when the open is refused (nothing was submitted).

    Cancellation: closed by its owner: no checkpoint between the open and the connection
    taking the stream
    (``answer_of`` is sync); a whole answer's at the stream's receive (``with source``
    closes it); a streaming one's in the body, or the connection's backstop, closes it.
    """
    runtime, timer = call.runtime, call.timer
    try:
        if choices > 1:
            streams = open_choices(
                runtime, choices_prepared(call.prepared, call.generation, choices), timer)
        else:
            streams = [open_owned(runtime, call.prepared, timer)]
    except Exception:
        if not_opened is not None:
            not_opened()
        raise
    answer = answer_of(streams)
    first = streams[0].request_id
    source: TokenStream | ChoicesSource = streams[0] if choices == 1 else ChoicesSource(streams)
    if streaming:
        return sse_response(
            EventStreamBody[Any](source, answer.encoder(),
                                 keepalive_s=runtime.settings.keepalive_s,
                                 keepalives=runtime.keepalives if choices == 1 else None,
                                 timer=timer),
            first, headers=answer.headers())
    with source:
        if isinstance(source, ChoicesSource):
            results = await collect_choices(source, timer)
        else:
            results = [await collect(source, timer)]
    return json_response(await answer.whole(results),
                         headers={"X-Request-ID": first, **answer.headers()})
