"""``/metrics``: the engine's per-band series (issue 48: priority bands, ``engine.priority``).

Read from ``/stats`` at scrape time, as the other gauges are (``metrics.RuntimeCollector``),
each band (a request's ``priority``, lower is sooner) a ``band`` label:

    streamscope_num_requests_waiting_by_band   gauge    waiting in the engine now
    streamscope_queue_wait_mean_seconds        gauge    mean wait before first admission
    streamscope_preemptions_by_band            counter  preempted sequences of the band
    streamscope_priority_preemptions           counter  preemptions for a higher band
    streamscope_queue_wait_longest_steps       gauge    most steps waited before an admission
    streamscope_aged_admissions_by_band        counter  admissions lifted by aging

A band says nothing of any API key (the per-key figures stay behind the metrics token
elsewhere), so these are served to every scraper.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# (metric name, /stats key, help, kind, scale) for the (band, value) pairs.
_BAND_SERIES = (
    ("streamscope_num_requests_waiting_by_band", "waiting_by_band",
     "Requests in the engine waiting for a batch slot or cache blocks, by band.", "gauge", 1.0),
    ("streamscope_queue_wait_mean_seconds", "wait_ms_by_band",
     "Mean time from submission to first admission, by band.", "gauge", 0.001),
    ("streamscope_preemptions_by_band", "preemptions_by_band",
     "Running sequences of the band preempted (for blocks or for a higher band).",
     "counter", 1.0),
    ("streamscope_queue_wait_longest_steps", "longest_wait_steps_by_band",
     "Most engine steps a sequence of the band waited before an admission (aging's floor).",
     "gauge", 1.0),
    ("streamscope_aged_admissions_by_band", "aged_admissions_by_band",
     "Admissions of the band's sequences lifted above it by aging.", "counter", 1.0),
)


def band_metrics(stats: Mapping[str, Any]) -> Iterable[Metric]:
    """The per-band families of one ``/stats`` snapshot (none before the engine's)."""
    for name, key, doc, kind, scale in _BAND_SERIES:
        pairs = stats.get(key)
        if pairs is None:
            continue
        family: GaugeMetricFamily | CounterMetricFamily = (
            GaugeMetricFamily(name, doc, labels=["band"]) if kind == "gauge"
            else CounterMetricFamily(name, doc, labels=["band"]))
        for band, value in pairs:
            family.add_metric([str(band)], value * scale)
        yield family
    yield CounterMetricFamily("streamscope_priority_preemptions",
                              "Running sequences preempted for a higher band's waiting one.",
                              value=stats.get("priority_preemptions") or 0)
