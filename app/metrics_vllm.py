"""vLLM's metric names beside ours, for the gateways, autoscalers and dashboards that read them.

The Kubernetes Gateway API Inference Extension's endpoint picker, KEDA scalers and vLLM's
Grafana dashboards query ``vllm:``-named series (``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc``, ...). Where one of ours means the same thing, ``/metrics``
serves it under vLLM's name too, with vLLM's ``model_name`` label; where the meaning
differs, it is not served under vLLM's name (a dashboard showing a wrong number is worse
than one showing none).

How: ``VllmNames`` is a collector that, at scrape time, reads the families our own
collectors produce and emits each mapped one again, renamed. Nothing is observed twice:
the per-token path (``metrics.RequestTimer``) is unchanged, and a scrape copies a few
dozen samples. A family hidden from an open ``/metrics``
(``metrics_runtime.TENANT_SERIES``) is hidden under vLLM's name as well, since it is
read from the same collector.

The mapping, and what each means (vLLM's documented list, ``docs/usage/metrics.md``):

    vllm:num_requests_running          gauge     sequences in the engine's batch
    vllm:num_requests_waiting          gauge     requests waiting for a slot or blocks
    vllm:kv_cache_usage_perc           gauge     KV blocks used over total (1 is full)
    vllm:prompt_tokens                 counter   prompt tokens of accepted requests
    vllm:generation_tokens             counter   generated tokens taken by clients
    vllm:num_preemptions               counter   sequences preempted (recomputed later)
    vllm:prefix_cache_queries          counter   prompt tokens looked up in the cache
    vllm:prefix_cache_hits             counter   of those, found cached
    vllm:request_success               counter   finished requests by finished_reason
    vllm:time_to_first_token_seconds   histogram arrival to the first token
    vllm:inter_token_latency_seconds   histogram between consecutive tokens
    vllm:e2e_request_latency_seconds   histogram arrival to the engine's finish
    vllm:request_queue_time_seconds    histogram accepted to the first token

Our histograms already use vLLM's bucket bounds (``metrics.TTFT_BUCKETS`` and the
others), so the renamed buckets are the ones its dashboards expect.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

# Our family name -> vLLM's, for families whose meaning is the same.
RENAMED = {
    "streamscope_num_requests_running": "vllm:num_requests_running",
    "streamscope_num_requests_waiting": "vllm:num_requests_waiting",
    "streamscope_kv_cache_usage_ratio": "vllm:kv_cache_usage_perc",
    "streamscope_prompt_tokens": "vllm:prompt_tokens",
    "streamscope_generation_tokens": "vllm:generation_tokens",
    "streamscope_preemptions": "vllm:num_preemptions",
    "streamscope_prefix_cache_queries": "vllm:prefix_cache_queries",
    "streamscope_prefix_cache_hits": "vllm:prefix_cache_hits",
    "streamscope_time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "streamscope_inter_token_latency_seconds": "vllm:inter_token_latency_seconds",
    "streamscope_e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "streamscope_request_queue_time_seconds": "vllm:request_queue_time_seconds",
}
# ``streamscope_requests_finished`` counts every stream's one ending; vLLM's
# ``request_success`` counts finished requests by its own reasons: stop, length, abort
# (a client or the server gave up on it) and error.
FINISHED = "streamscope_requests_finished"
REQUEST_SUCCESS = "vllm:request_success"
VLLM_FINISHED_REASON = {
    "eos": "stop", "stop": "stop", "length": "length",
    "cancelled": "abort", "slow_client": "abort", "shutdown": "abort",
    "deadline_missed": "abort", "engine_error": "error",
}


class VllmNames(Collector):
    """Re-emits ``sources``' mapped families under vLLM's names, labelled ``model_name``.

    Args:
        sources: the collectors whose families are read (our histograms and counters,
            and the runtime's collector); never the registry this is registered in,
            which would collect itself.
        model_name: the served model's name, as ``/v1/models`` lists it.
    """

    def __init__(self, sources: Sequence[Collector], model_name: str) -> None:
        self._sources = tuple(sources)
        self._model_name = model_name

    def collect(self) -> Iterable[Metric]:
        for source in self._sources:
            for family in source.collect():
                if family.name in RENAMED:
                    yield self._renamed(family, RENAMED[family.name])
                elif family.name == FINISHED:
                    yield self._request_success(family)

    def _renamed(self, family: Metric, name: str) -> Metric:
        out = Metric(name, family.documentation, family.type, family.unit)
        for sample in family.samples:
            out.samples.append(sample._replace(
                name=name + sample.name[len(family.name):],
                labels={**sample.labels, "model_name": self._model_name}))
        return out

    def _request_success(self, family: Metric) -> Metric:
        """Our endings summed into vLLM's four finished reasons."""
        totals: dict[str, float] = {}
        for sample in family.samples:
            if sample.name.endswith("_total"):
                reason = VLLM_FINISHED_REASON.get(sample.labels["finish_reason"], "abort")
                totals[reason] = totals.get(reason, 0.0) + sample.value
        out = Metric(REQUEST_SUCCESS, "Finished requests, by vLLM's finished_reason "
                     "(stop, length, abort, error).", "counter")
        for reason, total in sorted(totals.items()):
            out.samples.append(Sample(
                REQUEST_SUCCESS + "_total",
                {"finished_reason": reason, "model_name": self._model_name}, total))
        return out
