"""Prometheus metrics for ``GET /metrics``: one registry per app, text exposition format.

Owns the metric names and what each one measures. The routes, stream bodies, error
handlers and connection report to it through plain calls (``RequestTimer``,
``Metrics.refused``, ``Metrics.disconnected``); gauges are read at scrape time from
``Runtime.statistics()``, the same numbers ``/stats`` shows. Knows no engine internals.

Names follow vLLM's and SGLang's (``vllm:time_to_first_token_seconds`` becomes
``streamscope_time_to_first_token_seconds``): a ``streamscope_`` prefix, base units,
``_total`` on counters, and vLLM's bucket bounds; where the meaning is the same, the
series is also served under vLLM's own name (``metrics_vllm``), which gateways read.
Each app has its own ``CollectorRegistry``, never the process-wide default, so several
apps in one process (the tests) do not collide. Times come from ``time.monotonic()``.

What each request metric measures (every time is taken in the Trio thread):

    arrival      the route began (the request's head has arrived; its body not yet read)
    submitted    the engine accepted the request (body read, validated, tokenized)
    token i      the stream's reader took token i to write it (a stream body, or the
                 collecting loop of a whole answer): the client's view, not the engine's

    time_to_first_token_seconds   arrival -> token 0
    request_queue_time_seconds    submitted -> token 0: waiting for a batch slot and
                                  blocks, then the prefill step (the stream's WAITING
                                  state, the one ``STREAMSCOPE_MAX_WAITING`` limits);
                                  TTFT minus this is the app's own share
    inter_token_latency_seconds   token i-1 -> token i; a reader that fell behind takes
                                  queued tokens back to back, so its gaps are short
    e2e_request_latency_seconds   arrival -> the engine's finish (eos, length, stop)
                                  was taken; not observed for other endings

Every stream that opened ends once in ``streamscope_requests_finished_total`` with a
``finish_reason``: ``eos``, ``length``, ``stop`` (the engine finished it), ``slow_client``,
``engine_error``, ``shutdown`` (its last event was that error), or ``cancelled`` (it
ended otherwise: its client left, mostly). So the sum over reasons equals ``/stats``
``opened`` once no stream is open. Generated tokens count tokens taken by readers:
those the engine made after a client left are not in it.

Who may scrape. ``/metrics`` is open unless ``STREAMSCOPE_METRICS_TOKEN`` is set (then
``auth.py`` requires it as a bearer token). Open, it leaves out the prefix-cache series
(``metrics_runtime.TENANT_SERIES``): they move by a token count when a request finds its
prompt cached, so a stranger reading them learns when some key repeats a prompt (before
per-key cache namespaces, which key B's prompt key A had just sent: docs/security.md). The rest are
server-wide load figures a balancer or autoscaler reads without a secret.

Cost on the per-token path: one ``time.monotonic()``, one histogram observation (a
lock and a walk over 19 bounds) and one counter increment, a few microseconds; no
labels are looked up per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram
from quart import Blueprint, Response

from engine import FinishEvent, TokenEvent
from streams import StreamItem

from .errors import ApiError
from .metrics_runtime import RuntimeCollector
from .metrics_vllm import VllmNames

if TYPE_CHECKING:
    from .request_record import Recorder, RequestRecord

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# A ``_created`` series per counter and histogram doubles the output and no dashboard of
# vLLM's or SGLang's uses it. This switch is process-wide (prometheus_client offers no
# per-registry one); streamscope is the only user of prometheus_client in its process.
prometheus_client.disable_created_metrics()

# vLLM's bounds (vllm/v1/metrics/loggers.py), so dashboards built for it read ours.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

CANCELLED = "cancelled"  # the finish reason of a stream that ended without a last event


class Metrics:
    """The metrics of one app: its registry, request histograms and counters.

    Args:
        statistics: ``Runtime.statistics``; read at every scrape for the gauges.
        tenant_series: whether the exposition has ``TENANT_SERIES`` (only when a
            scrape needs a credential, ``STREAMSCOPE_METRICS_TOKEN``).
        model_name: the served model's name: the ``model_name`` label of the series
            also served under vLLM's names (``metrics_vllm``).
        recorder: each request's trace span and log line (``request_record.py``), or
            None when both are off: then a timer carries no record.
    """

    def __init__(self, statistics: Callable[[], Mapping[str, Any]], *,
                 tenant_series: bool = False, model_name: str = "streamscope",
                 recorder: Recorder | None = None) -> None:
        self.recorder = recorder
        self.registry = CollectorRegistry()
        r = self.registry
        self.time_to_first_token = Histogram(
            "streamscope_time_to_first_token_seconds",
            "From the request's arrival to its first token taken for the client.",
            buckets=TTFT_BUCKETS, registry=r)
        self.queue_time = Histogram(
            "streamscope_request_queue_time_seconds",
            "From the engine accepting the request to its first token: waiting for a "
            "batch slot and cache blocks, then the prefill step.",
            buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "streamscope_inter_token_latency_seconds",
            "Between consecutive tokens of one request, as its reader took them.",
            buckets=ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "streamscope_e2e_request_latency_seconds",
            "From the request's arrival to the engine's finish (eos, length, stop) taken.",
            buckets=REQUEST_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(
            "streamscope_prompt_tokens", "Prompt tokens of the requests the engine accepted.",
            registry=r)
        self.generation_tokens = Counter(
            "streamscope_generation_tokens", "Generated tokens taken for their clients.",
            registry=r)
        self.requests_finished = Counter(
            "streamscope_requests_finished",
            "Streams ended, by finish reason: eos, length, stop, slow_client, engine_error, "
            "shutdown, or cancelled (ended otherwise, mostly a client that left).",
            ["finish_reason"], registry=r)
        self.refusals = Counter(
            "streamscope_refusals",
            "Requests answered with the error envelope instead of a result, by status "
            "and error type.",
            ["status", "type"], registry=r)
        self.disconnects = Counter(
            "streamscope_client_disconnects",
            "Clients that left before their response was complete.", registry=r)
        runtime = RuntimeCollector(statistics, tenant_series)
        r.register(runtime)
        r.register(VllmNames([self.time_to_first_token, self.queue_time,
                              self.inter_token_latency, self.e2e_latency, self.prompt_tokens,
                              self.generation_tokens, self.requests_finished, runtime],
                             model_name))

    def start_request(self) -> RequestTimer:
        """A timer for one request, started now (call it first thing in the route)."""
        now = time.monotonic()
        record = None if self.recorder is None else self.recorder.start(now)
        return RequestTimer(self, now, record)

    def refused(self, error: ApiError) -> None:
        self.refusals.labels(status=str(error.status), type=error.type.value).inc()
        if self.recorder is not None:
            self.recorder.refused(error)

    def disconnected(self) -> None:
        self.disconnects.inc()

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (``CONTENT_TYPE``)."""
        return prometheus_client.generate_latest(self.registry)


class RequestTimer:
    """One request's times and its one ending; all methods are sync and cheap.

    ``submitted`` once the engine accepted the request; ``observe`` each item taken
    (``token``, then ``finished`` or ``failed``); ``close`` on every way out, which
    records ``cancelled`` if nothing ended it. Only the first ending counts. With a
    ``record`` (tracing or the JSON request log on), each of these tells it too.
    """

    __slots__ = ("_ended", "_last_token", "_metrics", "_record", "_submitted", "arrival")

    def __init__(self, metrics: Metrics, arrival: float,
                 record: RequestRecord | None = None) -> None:
        self._metrics = metrics
        self._record = record
        self.arrival = arrival
        self._submitted: float | None = None
        self._last_token: float | None = None
        self._ended = False

    def submitted(self, prompt_tokens: int, request_id: str | None = None,
                  max_tokens: int | None = None) -> None:
        """The engine accepted the request (its id and max_new_tokens, for the record)."""
        self._submitted = time.monotonic()
        self._metrics.prompt_tokens.inc(prompt_tokens)
        if self._record is not None:
            self._record.submitted(prompt_tokens, request_id, max_tokens)

    def observe(self, item: StreamItem) -> None:
        """One item taken from the stream: a token, or its last item."""
        if isinstance(item, TokenEvent):
            self.token()
        elif isinstance(item, FinishEvent):
            self.finished(item.reason.value)
        else:
            self.failed(item.type)

    def observe_all(self, items: list[StreamItem]) -> None:
        """Items taken together (one write): ``observe`` each, the tokens counted at once."""
        tokens = sum(isinstance(item, TokenEvent) for item in items)
        if tokens:
            self.token(tokens)
        for item in items:
            if not isinstance(item, TokenEvent):
                self.observe(item)

    def token(self, count: int = 1) -> None:
        """``count`` tokens taken together: the first after the time since the last one,
        the others 0 s after it (their reader gets them in one write)."""
        now = time.monotonic()
        m = self._metrics
        if self._last_token is None:
            m.time_to_first_token.observe(now - self.arrival)
            if self._submitted is not None:
                m.queue_time.observe(now - self._submitted)
            if self._record is not None:
                self._record.first_token = now
        else:
            m.inter_token_latency.observe(now - self._last_token)
        for _ in range(count - 1):
            m.inter_token_latency.observe(0.0)
        self._last_token = now
        m.generation_tokens.inc(count)
        if self._record is not None:
            self._record.tokens += count

    def finished(self, finish_reason: str) -> None:
        """The engine's finish (eos, length, stop) was taken."""
        if self._end(finish_reason):
            self._metrics.e2e_latency.observe(time.monotonic() - self.arrival)

    def failed(self, error_type: str) -> None:
        """The stream's last item was an error of this type."""
        self._end(error_type)

    def close(self) -> None:
        """On every way out; ``cancelled`` unless the stream ended already. Idempotent."""
        self._end(CANCELLED)
        if self._record is not None:
            self._record.closed()

    def _end(self, finish_reason: str) -> bool:
        if self._ended:
            return False
        self._ended = True
        self._metrics.requests_finished.labels(finish_reason=finish_reason).inc()
        if self._record is not None:
            self._record.ended(finish_reason)
        return True


def make_metrics_blueprint(metrics: Metrics) -> Blueprint:
    """``GET /metrics``: the app's registry, for Prometheus to scrape."""
    bp = Blueprint("metrics", __name__)

    @bp.get("/metrics")
    async def scrape() -> Response:
        """Cancellation: nothing to undo, as none can land: no checkpoint."""
        return Response(metrics.exposition(), status=200, content_type=CONTENT_TYPE)

    return bp
