"""What ``/stats`` becomes at scrape time: the gauges and counters ``metrics.Metrics``
reads from ``Runtime.statistics()`` on every scrape, by name, help and ``/stats`` key.

Its own job beside ``metrics``: those are observed as requests go (histograms,
counters); these are read, never observed, so they cost nothing between scrapes. Which
of them an open ``/metrics`` leaves out, and why, is ``TENANT_SERIES`` (``metrics``'
module docstring: who may scrape).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .metrics_bands import band_metrics

# (metric name, /stats key, help) for the gauges read at scrape time.
_GAUGES = (
    ("streamscope_num_requests_running", "running",
     "Sequences in the engine's batch (admitted, not finished)."),
    ("streamscope_num_requests_waiting", "waiting",
     "Requests in the engine waiting for a batch slot or cache blocks."),
    ("streamscope_num_requests_paused", "paused",
     "Running sequences left out of decode because their reader is behind."),
    ("streamscope_num_streams_open", "streams_open", "Streams open in the hub."),
    ("streamscope_kv_cache_blocks_total", "blocks_total", "KV-cache blocks in the pool."),
    ("streamscope_kv_cache_blocks_cached", "blocks_cached",
     "KV-cache blocks held by the prefix cache: full, shared or evictable."),
    ("streamscope_kv_cache_blocks_filled", "blocks_filled",
     "KV-cache blocks holding a cached position of a running sequence (of those used)."),
    ("streamscope_step_margin", "step_margin",
     "With a step-time target: how much longer than planned recent steps with prompt "
     "tokens and decode rows ran (95th percentile of actual / planned); their budget is "
     "planned within the target over it."),
    ("streamscope_resumable_streams", "resumable_streams",
     "Resumable streams held: running, or ended with their log kept for the grace period."),
    ("streamscope_resumable_streams_detached", "resumable_detached",
     "Resumable streams no reader holds (kept for the grace period)."),
    ("streamscope_resume_log_bytes", "resume_log_bytes",
     "Bytes in the event logs of resumable streams."),
    ("streamscope_resume_detached_bytes", "resume_detached_bytes",
     "Bytes in the event logs of resumable streams no reader holds (capped)."),
    ("streamscope_resume_store_pending", "resume_store_pending",
     "Commands to the shared resume store queued, not yet written (0 without one)."),
)
# (metric name, /stats key, help) for the engine's counters.
_ENGINE_COUNTERS = (
    ("streamscope_preemptions", "preemptions",
     "Running sequences whose cache blocks were taken back, to be recomputed later."),
    ("streamscope_recomputed_tokens", "recomputed_tokens",
     "Positions prefilled again for sequences readmitted after a preemption."),
    ("streamscope_prefix_cache_queries", "prefix_cache_queries",
     "Prompt positions looked up in the prefix cache at admission (tokens)."),
    ("streamscope_prefix_cache_hits", "prefix_cache_hits",
     "Of the prompt positions looked up, those found cached, not prefilled (tokens)."),
    ("streamscope_kv_cache_blocks_evicted", "blocks_evicted",
     "Cached, unreferenced KV-cache blocks given to other positions (least recent first)."),
)
# (metric name, /stats key, help) for the resumption registry's counters.
_RESUME_COUNTERS = (
    ("streamscope_resumes", "resumes", "Readers that resumed a stream (GET /v1/stream/<id>)."),
    ("streamscope_resume_expiries", "resume_expiries",
     "Resumable streams whose grace period ran out with no reader (cancelled if running)."),
    ("streamscope_resume_overflows", "resume_overflows",
     "Resumable streams ended (error resume_log_full) for the cap on detached bytes."),
    ("streamscope_resume_cancels", "resume_cancels",
     "Resumable streams ended by DELETE /v1/requests/<id>."),
    ("streamscope_resume_store_batches", "resume_store_batches",
     "Batches of commands written to the shared resume store."),
    ("streamscope_resume_store_failed_batches", "resume_store_failed_batches",
     "Batches that failed to reach the shared resume store (then tried again)."),
    ("streamscope_resume_store_refused", "resume_store_refused",
     "Commands the shared resume store refused."),
    ("streamscope_resume_store_dropped", "resume_store_dropped",
     "Commands to the shared resume store not queued: its queue was full."),
    ("streamscope_resume_store_cut_streams", "resume_store_cut_streams",
     "Resumable streams ended (error unavailable): the shared resume store's queue was full."),
    ("streamscope_resume_store_read_errors", "resume_store_read_errors",
     "Reads and lease renewals the shared resume store did not answer."),
    ("streamscope_resume_spec_rejected", "resume_spec_rejected",
     "Failovers refused: the stored spec or events failed their HMAC or the limits."),
    ("streamscope_resume_events_rejected", "resume_events_rejected",
     "Reads of another replica's stream ended: an event in the store failed its HMAC."),
    ("streamscope_resume_remote_cancels", "resume_remote_cancels",
     "DELETEs of resumable streams another replica generates (cancelled through the store)."),
)

# (metric name, /stats key, help) for the hub's TTFT-deadline counters.
_DEADLINE_COUNTERS = (
    ("streamscope_deadline_refusals", "refused_deadline",
     "Requests refused at arrival (429 deadline_unmeetable): the estimated first token "
     "came after their TTFT deadline."),
    ("streamscope_deadline_misses", "deadline_misses",
     "Admitted requests let go unstarted at their TTFT deadline (error deadline_missed)."),
)


# The series that say when some key's prompt was found cached (see the module docstring).
TENANT_SERIES = frozenset({"streamscope_prefix_cache_queries", "streamscope_prefix_cache_hits",
                           "streamscope_kv_cache_blocks_cached",
                           "streamscope_kv_cache_blocks_filled",
                           "streamscope_kv_cache_blocks_evicted"})


class RuntimeCollector(Collector):
    """Gauges (and the hub's counters) read from ``/stats`` at scrape time; without
    ``tenant_series``, none of ``TENANT_SERIES``."""

    def __init__(self, statistics: Callable[[], Mapping[str, Any]],
                 tenant_series: bool = False) -> None:
        self._statistics = statistics
        self._hidden = frozenset() if tenant_series else TENANT_SERIES

    def collect(self) -> Iterable[Metric]:
        stats = self._statistics()
        for name, key, doc in _GAUGES:
            if stats.get(key) is not None and name not in self._hidden:
                yield GaugeMetricFamily(name, doc, value=stats[key])
        total, free = stats.get("blocks_total"), stats.get("blocks_free")
        if total is not None and free is not None:
            yield GaugeMetricFamily("streamscope_kv_cache_blocks_used",
                                    "KV-cache blocks held by sequences.", value=total - free)
            yield GaugeMetricFamily("streamscope_kv_cache_usage_ratio",
                                    "KV-cache blocks used over total (1 is full).",
                                    value=(total - free) / total if total else 0.0)
        yield CounterMetricFamily("streamscope_slow_client_drops",
                                  "Streams the slow-reader policy ended with slow_client.",
                                  value=stats.get("slow_client_drops") or 0)
        for name, key, doc in _DEADLINE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=stats.get(key) or 0)
        for name, key, doc in _ENGINE_COUNTERS + _RESUME_COUNTERS:
            if name not in self._hidden:
                yield CounterMetricFamily(name, doc, value=stats.get(key) or 0)
        yield from band_metrics(stats)  # per band (engine.priority)
