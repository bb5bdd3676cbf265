"""Traces: W3C ``traceparent`` in, one OpenTelemetry span per request out over OTLP/HTTP.

Owns the trace context's parsing and the spans; knows nothing of how a request is served
(``request_record.py`` tells it, once per request, what happened and when).

Off by default. Without ``STREAMSCOPE_OTLP_ENDPOINT`` nothing here imports OpenTelemetry
and no span is made: a request's ``traceparent`` is only parsed (``TraceParent.parse``,
plain string checks) so that the JSON request log can name its trace. The standard
``OTEL_EXPORTER_OTLP_ENDPOINT`` does not turn export on (settings are read in one place,
and a variable meant for another program's SDK in the same environment must not start
this server posting to a collector); the SDK still reads the other ``OTEL_*`` variables
it knows for an exporter it makes (``OTEL_EXPORTER_OTLP_HEADERS`` for a collector's
credentials, ``..._TIMEOUT``, ``..._COMPRESSION``, ``OTEL_BSP_*``, ``OTEL_TRACES_SAMPLER``).

With an endpoint, ``Tracing`` owns one ``TracerProvider`` for its app (never the
process-wide one, so several apps in a process keep apart) with a ``BatchSpanProcessor``:
``span.end()`` only appends to its queue; the processor's own thread encodes the spans
as protobuf and POSTs them to ``<endpoint>/v1/traces``. Nothing on the Trio loop waits
for a collector; a collector that is down costs dropped spans (the queue's bound,
``OTEL_BSP_MAX_QUEUE_SIZE``, 2048 by default), never a slower stream.

One request, one SERVER span (as vLLM's ``llm_request``) named ``{operation} {model}``
(the GenAI conventions' span name), a child of the incoming ``traceparent`` when it is
valid, started at the request's arrival and ended at its one ending, with the GenAI
attributes (``GENAI_CONVENTIONS``), an event ``gen_ai.first_token`` at the first token
taken for the client, and three children with the times the app sees:

    streamscope.prepare            arrival -> submitted: the body read and validated, the
                                   chat template rendered, the prompt tokenized
    streamscope.queue_and_prefill  submitted -> first token: waiting for a batch slot and
                                   blocks, then the prefill step (the app cannot see where
                                   one ends and the other begins: the engine's admission
                                   happens in its thread, unreported)
    streamscope.decode             first token -> the ending: every later token

A malformed or oversized ``traceparent`` is ignored (a new trace), never refused.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # only imported, lazily, when an endpoint is set
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

# The GenAI semantic conventions' names (https://opentelemetry.io/docs/specs/semconv/gen-ai/
# gen-ai-spans/, Development status, as of semconv 1.37-1.41).
GENAI_CONVENTIONS = "https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/"
FIRST_TOKEN_EVENT = "gen_ai.first_token"
TRACES_PATH = "/v1/traces"  # OTLP/HTTP's path under the collector's base URL

# W3C Trace Context: version 00 is exactly 55 characters; a later version may append
# fields, so longer is read by its first four. Beyond these caps a header is ignored.
MAX_TRACEPARENT_CHARS = 256
MAX_TRACESTATE_CHARS = 512  # what the spec asks every vendor to propagate, at least
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A valid W3C ``traceparent``: the caller's trace and span, and its flags."""

    trace_id: str  # 32 lowercase hex digits, not all zero
    span_id: str  # 16 lowercase hex digits, not all zero
    flags: int  # bit 0: the caller sampled it

    @classmethod
    def parse(cls, header: str | None) -> TraceParent | None:
        """The header's trace context, or None when absent, too long or malformed (the
        W3C rules: version ff invalid; version 00 exactly four fields; zero ids invalid)."""
        if header is None or len(header) > MAX_TRACEPARENT_CHARS:
            return None
        match = _TRACEPARENT.fullmatch(header.strip())
        if match is None:
            return None
        version, trace_id, span_id, flags, rest = match.groups()
        if version == "ff" or (version == "00" and rest is not None):
            return None
        if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
            return None
        return cls(trace_id, span_id, int(flags, 16))

    def header(self) -> str:
        return f"00-{self.trace_id}-{self.span_id}-{self.flags:02x}"


class SpanFacts(Protocol):
    """What a span says of its request (``request_record.RequestRecord`` has them):
    times in ``time.monotonic()`` seconds, ``epoch_ns`` to convert them."""

    arrival: float
    submitted_at: float | None
    first_token: float | None
    ended_at: float | None
    last_seen: float
    operation: str
    model: str
    route: str | None
    key_name: str | None
    request_id: str | None
    prompt_tokens: int | None
    max_tokens: int | None
    tokens: int
    finish: str | None
    status: int | None

    def epoch_ns(self, t: float) -> int: ...

    @property
    def failed(self) -> bool: ...


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector's base URL (``http://host:4318``), as the
    SDK builds it from ``OTEL_EXPORTER_OTLP_ENDPOINT``; a URL that already ends with
    ``/v1/traces`` is taken as it is."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith(TRACES_PATH) else endpoint + TRACES_PATH


class Tracing:
    """One app's tracer: its provider, its batch processor and OTLP/HTTP exporter.

    Args:
        endpoint: the collector's base URL (``STREAMSCOPE_OTLP_ENDPOINT``).
        service_instance: this replica's name (``service.instance.id``).
    """

    def __init__(self, endpoint: str, service_instance: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        resource = Resource.create({"service.name": "streamscope",
                                    "service.instance.id": service_instance})
        self.provider: TracerProvider = TracerProvider(resource=resource)
        self.provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self._tracer = self.provider.get_tracer("streamscope")
        self._lock = threading.Lock()  # shutdown once, from whichever thread comes first
        self._shut = False

    def start(self, name: str, parent: TraceParent | None, tracestate: str | None,
              start_ns: int) -> Span:
        """The request's SERVER span, started at ``start_ns`` (epoch nanoseconds), a
        child of ``parent`` (with its ``tracestate``) if there is one."""
        from opentelemetry import trace
        from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceState

        context = None
        if parent is not None:
            state = TraceState.from_header([tracestate]) if tracestate and \
                len(tracestate) <= MAX_TRACESTATE_CHARS else TraceState()
            remote = SpanContext(int(parent.trace_id, 16), int(parent.span_id, 16),
                                 is_remote=True, trace_flags=trace.TraceFlags(parent.flags),
                                 trace_state=state)
            context = trace.set_span_in_context(NonRecordingSpan(remote))
        return self._tracer.start_span(name, context=context, kind=SpanKind.SERVER,
                                       start_time=start_ns)

    def end(self, span: Span, record: SpanFacts) -> None:
        """End ``span`` with what ``record`` says: attributes, the first token's event,
        the three children (each only when both its ends are known). Sync: the export
        happens in the processor's thread."""
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        span.set_attributes(_attributes(record))
        ns = record.epoch_ns
        first = record.first_token
        if first is not None:
            span.add_event(FIRST_TOKEN_EVENT, {"gen_ai.server.time_to_first_token":
                                               round(first - record.arrival, 6)},
                           timestamp=ns(first))
        end = record.ended_at
        children = (("streamscope.prepare", record.arrival, record.submitted_at),
                    ("streamscope.queue_and_prefill", record.submitted_at, first),
                    ("streamscope.decode", first, end))
        parent = trace.set_span_in_context(span)
        for name, begin, finish in children:
            if begin is not None and finish is not None:
                child = self._tracer.start_span(name, context=parent, start_time=ns(begin))
                child.end(end_time=ns(finish))
        # OTel's HTTP rule for a server span: a 4xx is the caller's doing, not an error;
        # a 5xx is, and so is a stream that ended with an error event after its 200.
        status = record.status
        if (status is not None and status >= 500) or (
                record.failed and (status is None or status < 400)):
            span.set_status(Status(StatusCode.ERROR, record.finish or "error"))
        span.end(end_time=ns(end if end is not None else record.last_seen))

    def shutdown(self) -> None:
        """Export what is queued and stop the processor's thread (blocks up to the
        exporter's timeout: call it in a worker thread). Idempotent."""
        with self._lock:
            if self._shut:
                return
            self._shut = True
        self.provider.shutdown()


def _attributes(record: SpanFacts) -> dict[str, Any]:
    """The GenAI conventions' attributes of the request, and ours (``streamscope.*``)."""
    attributes: dict[str, Any] = {
        "gen_ai.operation.name": record.operation,
        "gen_ai.provider.name": "streamscope",
        "gen_ai.request.model": record.model,
        "gen_ai.response.model": record.model,
        "gen_ai.usage.output_tokens": record.tokens,
        "http.route": record.route or "",
    }
    optional = {"gen_ai.usage.input_tokens": record.prompt_tokens,
                "gen_ai.request.max_tokens": record.max_tokens,
                "gen_ai.response.id": record.request_id,
                "http.response.status_code": record.status,
                "streamscope.api_key.name": record.key_name}
    attributes.update({k: v for k, v in optional.items() if v is not None})
    if record.finish is not None:
        attributes["gen_ai.response.finish_reasons"] = [record.finish]
    return attributes
