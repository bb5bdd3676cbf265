"""``/metrics`` also speaks vLLM's names (issue 47, item 3): a gateway's endpoint picker,
KEDA or vLLM's Grafana dashboards find the series they query, with vLLM's types, units
and ``model_name`` label, and the same values as ours. Real HTTP, a real scrape parsed by
prometheus_client.
"""

from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from tests.http_clients import long_body, parse_sse, stream_body
from tests.http_server import RunningServer, StartServer
from tests.test_app_metrics import Samples, scrape, value

# vLLM's documented series (docs/usage/metrics.md, its v1 metrics logger) that streamscope
# serves: name as the text format's family (prometheus_client drops a counter's _total)
# -> type. Every time is in seconds, as the names say.
VLLM_SERIES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}
# Counted per tenant's prompts: only served behind STREAMSCOPE_METRICS_TOKEN.
VLLM_TENANT_SERIES = {"vllm:prefix_cache_queries": "counter",
                      "vllm:prefix_cache_hits": "counter"}
MODEL = {"model_name": "tiny-gpt2"}


async def families(server: RunningServer, token: str | None = None) -> dict[str, str]:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with server.client() as client:
        response = await client.get("/metrics", headers=headers)
    assert response.status_code == 200
    return {family.name: family.type for family in text_string_to_metric_families(response.text)
            if family.name.startswith("vllm:")}


def vllm(samples: Samples, name: str, **labels: str) -> float:
    return value(samples, name, **MODEL, **labels)


async def test_vllm_names_types_and_units_as_documented(server: RunningServer) -> None:
    assert await families(server) == VLLM_SERIES  # the tenant series are not open


async def test_prefix_cache_series_under_vllm_names_only_with_the_metrics_token(
    start_server: StartServer,
) -> None:
    server = await start_server(metrics_token="scrape-secret-0123456789-0123456789")

    assert await families(server, "scrape-secret-0123456789-0123456789") == {
        **VLLM_SERIES, **VLLM_TENANT_SERIES}


async def test_vllm_series_carry_the_same_values_as_ours(server: RunningServer) -> None:
    async with server.client() as client:
        for max_new_tokens in (3, 5):
            response = await client.post(
                "/v1/stream", json=stream_body(max_new_tokens=max_new_tokens, ignore_eos=True))
            assert json.loads(parse_sse(response.content)[-1].data)["finish_reason"] == "length"
    await server.wait_for(lambda: server.hub.statistics().streams_open == 0, "streams closed")
    leaving = server.raw_client()  # a client that leaves: vLLM's "abort"
    await leaving.post("/v1/stream", long_body())
    await leaving.read_tokens(1)
    leaving.close_abort()
    await server.wait_for(lambda: server.hub.statistics().streams_open == 0, "stream closed")

    samples = await scrape(server)
    for ours, theirs in (("streamscope_prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("streamscope_generation_tokens_total",
                          "vllm:generation_tokens_total"),
                         ("streamscope_preemptions_total", "vllm:num_preemptions_total"),
                         ("streamscope_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc"),
                         ("streamscope_time_to_first_token_seconds_count",
                          "vllm:time_to_first_token_seconds_count"),
                         ("streamscope_time_to_first_token_seconds_sum",
                          "vllm:time_to_first_token_seconds_sum")):
        assert vllm(samples, theirs) == value(samples, ours), theirs
    assert vllm(samples, "vllm:generation_tokens_total") >= 3 + 5 + 1
    assert vllm(samples, "vllm:time_to_first_token_seconds_count") == 3
    assert vllm(samples, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == 3
    assert vllm(samples, "vllm:request_success_total", finished_reason="length") == 2
    assert vllm(samples, "vllm:request_success_total", finished_reason="abort") == 1
