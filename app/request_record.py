"""One request's record for its trace span and its log line, written once at its end.

Owns what is known of a request outside its text (never a prompt or an output): its
route, API key name, trace context, request id, token counts, the times its metrics
timer saw (``metrics.RequestTimer`` reports to it: arrival, submit, first token, the
one ending), its HTTP status, and when all of that is known. It hands the finished
record to the two sinks, the span (``tracing.py``) and the JSON log line
(``request_log.py``); it knows neither's format.

Built only when a sink is on (``Recorder.from_settings``): with no OTLP endpoint and
the text log format, timers carry no record and nothing here runs per request.

When a record is complete, and so written, once:

* a stream (its status, 200, is sent before its tokens): at its one ending (eos,
  length, stop, an error event, or ``cancelled``: its client left);
* a whole answer (its status comes after the ending): at its response (``after_request``:
  200, or the status of the error its stream's failure became);
* a request refused before it was submitted (4xx, 429, 503): at its response, with the
  refusal's error type as its finish;
* a stream made outside a request (a failover's rebuild, ``runtime/rebuild.py``): at its
  ending, with no status;
* otherwise at the timer's ``close`` (every owner closes it: a whole answer whose client
  left before its response), with what is known then.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import trio
from quart import Quart, Response, has_request_context, request

from .errors import ApiError
from .request_log import RequestLog
from .tracing import TraceParent, Tracing

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from .settings import Settings

SCOPE_KEY = "streamscope.record"  # the ASGI scope's key for the request's record
TRACE_RESPONSE = "traceresponse"  # W3C Trace Context Level 2's response header
# The GenAI operation each route performs; the others (prompt in, continuation out) are
# text completions.
CHAT_ROUTES = frozenset({"/v1/chat/completions", "/v1/messages", "/v1/responses"})
# The finishes that are no failure: the engine's three and a client that left.
CLEAN_FINISHES = frozenset({"eos", "length", "stop", "cancelled"})


class RequestRecord:
    """What one request did, filled in by its timer and its response; see the module
    docstring for when it is written. All methods sync, never a checkpoint."""

    def __init__(self, recorder: Recorder, arrival: float, *, in_request: bool) -> None:
        self._recorder = recorder
        self.arrival = arrival  # time.monotonic(), the timer's
        self._wall_ns, self._mono = time.time_ns(), time.monotonic()
        self.in_request = in_request
        self.model = recorder.model
        self.replica = recorder.replica
        self.route: str | None = None
        self.operation = "text_completion"
        self.key_name: str | None = None
        self.parent: TraceParent | None = None
        self.span: Span | None = None
        self.request_id: str | None = None
        self.prompt_tokens: int | None = None
        self.max_tokens: int | None = None
        self.tokens = 0  # taken for the client (the timer adds them)
        self.submitted_at: float | None = None
        self.first_token: float | None = None  # the timer sets it
        self.ended_at: float | None = None
        self.finish: str | None = None
        self.error_type: str | None = None  # a refusal's, before or after the ending
        self.status: int | None = None
        self.last_seen = arrival
        self.written = False

    def epoch_ns(self, t: float) -> int:
        """A ``time.monotonic()`` time as epoch nanoseconds (what a span takes)."""
        return self._wall_ns + int((t - self._mono) * 1e9)

    @property
    def failed(self) -> bool:
        return self.finish is not None and self.finish not in CLEAN_FINISHES

    @property
    def trace_id(self) -> str | None:
        """The trace it belongs to: its span's, else the caller's ``traceparent``'s."""
        if self.span is not None:
            return f"{self.span.get_span_context().trace_id:032x}"
        return None if self.parent is None else self.parent.trace_id

    @property
    def span_id(self) -> str | None:
        return None if self.span is None else f"{self.span.get_span_context().span_id:016x}"

    def fields(self) -> dict[str, Any]:
        """Its request log line's fields (``request_log.py`` says what each means)."""
        ended = self.ended_at if self.ended_at is not None else self.last_seen
        first = self.first_token
        return {
            "request_id": self.request_id,
            "key": self.key_name,
            "route": self.route,
            "status": self.status,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.tokens,
            "ttft_s": None if first is None else round(first - self.arrival, 6),
            "duration_s": round(ended - self.arrival, 6),
            "finish": self.finish,
            "replica": self.replica,
            "trace_id": self.trace_id,
            "span_id": self.span_id,
        }

    def submitted(self, prompt_tokens: int, request_id: str | None,
                  max_tokens: int | None) -> None:
        self.submitted_at = time.monotonic()
        self.prompt_tokens, self.request_id, self.max_tokens = \
            prompt_tokens, request_id, max_tokens

    def ended(self, finish: str) -> None:
        """The timer's one ending."""
        self.ended_at = self.last_seen = time.monotonic()
        self.finish = finish
        if self.status is not None or not self.in_request:
            self.write()

    def responded(self, status: int) -> None:
        """The response's status, as it is sent (its headers)."""
        self.status, self.last_seen = status, time.monotonic()
        if self.ended_at is not None:
            self.write()
        elif self.submitted_at is None and status >= 400:  # refused before it opened
            self.finish = self.error_type
            self.write()

    def closed(self) -> None:
        """Its timer's close: the last word on it."""
        self.write()

    def write(self) -> None:
        """Hand it to the sinks, once."""
        if not self.written:
            self.written = True
            self._recorder.write(self)


class Recorder:
    """The sinks of one app's request records: the tracer, the request log, or both.

    Args:
        model: the served model's name (both GenAI model attributes: a request's own
            ``model``, which is this name or its alias, is not seen here).
        replica: this replica's name in every record.
        key_name: the name of the API key of the request being served (``auth.key_name``).
    """

    def __init__(self, *, model: str, replica: str, tracing: Tracing | None,
                 log: RequestLog | None, key_name: Callable[[], str | None]) -> None:
        self.model, self.replica = model, replica
        self.tracing, self.log = tracing, log
        self._key_name = key_name

    @classmethod
    def from_settings(cls, settings: Settings,
                      key_name: Callable[[], str | None]) -> Recorder | None:
        """The app's recorder, or None when neither sink is on (the default)."""
        if settings.otlp_endpoint is None and settings.log_format != "json":
            return None
        replica = settings.replica or socket.gethostname()
        tracing = None if settings.otlp_endpoint is None else \
            Tracing(settings.otlp_endpoint, replica)
        log = RequestLog() if settings.log_format == "json" else None
        return cls(model=settings.model, replica=replica, tracing=tracing, log=log,
                   key_name=key_name)

    def start(self, arrival: float) -> RequestRecord:
        """A record for the request being served (its headers, route and key read now),
        or for a stream made outside any request. Sync, never a checkpoint."""
        in_request = has_request_context()
        record = RequestRecord(self, arrival, in_request=in_request)
        state = None
        if in_request:
            rule = request.url_rule
            record.route = rule.rule if rule is not None else request.path
            record.operation = "chat" if record.route in CHAT_ROUTES else "text_completion"
            record.key_name = self._key_name()
            record.parent = TraceParent.parse(request.headers.get("traceparent"))
            state = request.headers.get("tracestate")
            cast(dict[str, Any], request.scope)[SCOPE_KEY] = record
        if self.tracing is not None:
            record.span = self.tracing.start(f"{record.operation} {record.model}",
                                             record.parent, state, record.epoch_ns(arrival))
        return record

    def refused(self, error: ApiError) -> None:
        """The current request is answered with ``error`` (``Metrics.refused``)."""
        record = _current()
        if record is not None:
            record.error_type = error.type.value

    def write(self, record: RequestRecord) -> None:
        if self.tracing is not None and record.span is not None:
            self.tracing.end(record.span, record)
        if self.log is not None:
            self.log.write(record.fields())

    def register(self, app: Quart) -> None:
        """Read each response's status; with a span, send ``traceresponse``."""

        @app.after_request
        async def responded(response: Response) -> Response:
            """Cancellation: nothing to undo, as none can land: no checkpoint."""
            record = _current()
            if record is not None:
                if record.span is not None:
                    flags = int(record.span.get_span_context().trace_flags)
                    response.headers[TRACE_RESPONSE] = \
                        f"00-{record.trace_id}-{record.span_id}-{flags:02x}"
                record.responded(response.status_code)
            return response

        @app.after_serving
        async def flush() -> None:
            """Export the spans still queued. Cancellation: finished first: the export's
            thread is waited for (never abandoned: the spans are the last record of the
            server's requests), bounded by the exporter's own timeout."""
            if self.tracing is not None:
                await trio.to_thread.run_sync(self.tracing.shutdown)


def _current() -> RequestRecord | None:
    if not has_request_context():
        return None
    record: RequestRecord | None = cast(dict[str, Any], request.scope).get(SCOPE_KEY)
    return record
