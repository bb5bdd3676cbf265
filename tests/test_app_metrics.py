"""``GET /metrics`` over real HTTP: real traffic, then a scrape parsed by prometheus_client.

Streams that finish (``/v1/stream``, ``/v1/generate``, streamed ``/v1/completions``), a
refusal (422) and a client that leaves (an RST after three tokens); then the counts in
the scrape must agree with ``/stats``, with what the clients received, and with what the
engine recorded.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.http_clients import long_body, parse_sse, stream_body
from tests.http_server import RunningServer, StartServer

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
TOKENS_READ = 3  # the client that leaves reads this many tokens first


async def scrape(server: RunningServer) -> Samples:
    async with server.client() as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def stats(server: RunningServer) -> dict[str, Any]:
    async with server.client() as client:
        response = await client.get("/stats")
    result: dict[str, Any] = response.json()
    return result


async def run_finishing_traffic(server: RunningServer) -> tuple[int, int]:
    """Four requests that end with length: (prompt tokens, completion tokens) in all."""
    prompt_tokens = completion_tokens = 0
    async with server.client() as client:
        for max_new_tokens in (5, 7):
            response = await client.post(
                "/v1/stream", json=stream_body(max_new_tokens=max_new_tokens, ignore_eos=True))
            done = json.loads(parse_sse(response.content)[-1].data)
            assert done["finish_reason"] == "length"
            prompt_tokens += done["usage"]["prompt_tokens"]
            completion_tokens += done["usage"]["completion_tokens"]
        response = await client.post(
            "/v1/generate", json=stream_body(max_new_tokens=4, ignore_eos=True))
        usage = response.json()["usage"]
        response = await client.post("/v1/completions", json={
            "prompt": "The capital of France is", "max_tokens": 3, "stream": True})
    chunks = [e.data for e in parse_sse(response.content)]
    assert chunks[-1] == "[DONE]"
    assert json.loads(chunks[-2])["choices"][0]["finish_reason"] == "length"
    return (prompt_tokens + 2 * usage["prompt_tokens"],
            completion_tokens + usage["completion_tokens"] + 3)


async def test_finished_streams_agree_with_stats_and_usage(server: RunningServer) -> None:
    prompt_tokens, completion_tokens = await run_finishing_traffic(server)
    # A client may read its last event before the engine's step that made it has released
    # the sequence and the hub has closed the stream: the counts settle just after.
    await server.wait_for(lambda: server.recorder.statistics().releases == 4
                          and server.hub.statistics().streams_open == 0, "four releases")

    samples, current = await scrape(server), await stats(server)
    assert value(samples, "streamscope_generation_tokens_total") == completion_tokens == 19
    assert value(samples, "streamscope_prompt_tokens_total") == prompt_tokens
    finished = {labels: v for (name, labels), v in samples.items()
                if name == "streamscope_requests_finished_total"}
    assert finished == {(("finish_reason", "length"),): 4}
    assert sum(finished.values()) == current["opened"] == current["releases"] == 4
    assert value(samples, "streamscope_time_to_first_token_seconds_count") == 4
    assert value(samples, "streamscope_request_queue_time_seconds_count") == 4
    assert value(samples, "streamscope_inter_token_latency_seconds_count") == 19 - 4
    assert value(samples, "streamscope_e2e_request_latency_seconds_count") == 4
    # hypercorn reports http.disconnect after every response: none of these clients left.
    assert value(samples, "streamscope_client_disconnects_total") == 0
    # TTFT starts at arrival, the queue time only once the engine accepted the request.
    assert (value(samples, "streamscope_time_to_first_token_seconds_sum")
            >= value(samples, "streamscope_request_queue_time_seconds_sum") > 0)
    assert (value(samples, "streamscope_e2e_request_latency_seconds_sum")
            >= value(samples, "streamscope_time_to_first_token_seconds_sum"))


async def test_refusal_is_counted_by_status_and_type(server: RunningServer) -> None:
    async with server.client() as client:
        refused = await client.post("/v1/stream", json={"prompt": "x", "unknown": 1})
        missing = await client.get("/no/such/route")

    samples = await scrape(server)
    assert (refused.status_code, missing.status_code) == (422, 404)
    assert value(samples, "streamscope_refusals_total",
                 status="422", type="invalid_request") == 1
    assert value(samples, "streamscope_refusals_total", status="404", type="not_found") == 1
    assert value(samples, "streamscope_client_disconnects_total") == 0
    assert not any(name == "streamscope_requests_finished_total" for name, _ in samples)
    assert value(samples, "streamscope_prompt_tokens_total") == 0


async def test_client_that_leaves_is_counted_once_as_cancelled_and_disconnect(
    server: RunningServer,
) -> None:
    client = server.raw_client()
    await client.post("/v1/stream", long_body())
    await client.read_tokens(TOKENS_READ)
    request_id = client.request_id()
    server.recorder.hold()  # it cannot end on its own before the server notices the close
    client.close_abort()
    await server.wait_for(lambda: request_id in server.recorder.cancel_marks, "the cancel")
    server.recorder.release()
    finish = await server.wait_finished(request_id)
    await server.wait_for(lambda: server.hub.statistics().streams_open == 0, "stream closed")

    samples, current = await scrape(server), await stats(server)
    assert value(samples, "streamscope_client_disconnects_total") == 1
    assert value(samples, "streamscope_requests_finished_total", finish_reason="cancelled") == 1
    assert current["opened"] == current["closes"] == 1
    # Tokens count as taken for the client: at least those it read, at most the engine's.
    taken = value(samples, "streamscope_generation_tokens_total")
    assert TOKENS_READ <= taken <= finish.completion_tokens
    assert value(samples, "streamscope_e2e_request_latency_seconds_count") == 0


async def test_gauges_agree_with_stats_while_a_stream_runs(server: RunningServer) -> None:
    client = server.raw_client()
    await client.post("/v1/stream", long_body())
    await client.read_tokens(1)
    server.recorder.hold()  # the engine's statistics stay put until release()

    samples, current = await scrape(server), await stats(server)
    used = current["blocks_total"] - current["blocks_free"]
    assert used > 0
    assert value(samples, "streamscope_kv_cache_blocks_used") == used
    assert value(samples, "streamscope_kv_cache_blocks_total") == current["blocks_total"]
    assert value(samples, "streamscope_kv_cache_usage_ratio") == used / current["blocks_total"]
    assert value(samples, "streamscope_num_requests_running") == current["running"] == 1
    assert value(samples, "streamscope_num_requests_waiting") == current["waiting"] == 0
    assert value(samples, "streamscope_num_requests_paused") == current["paused"]
    assert value(samples, "streamscope_num_streams_open") == current["streams_open"] == 1
    assert (value(samples, "streamscope_slow_client_drops_total")
            == current["slow_client_drops"] == 0)
    server.recorder.release()
    client.close_abort()


async def test_each_app_has_its_own_registry(start_server: StartServer) -> None:
    busy, idle = await start_server(), await start_server()
    async with busy.client() as client:
        await client.post("/v1/generate", json=stream_body(max_new_tokens=2, ignore_eos=True))

    assert value(await scrape(busy), "streamscope_generation_tokens_total") == 2
    assert value(await scrape(idle), "streamscope_generation_tokens_total") == 0


async def test_metrics_is_the_text_format_without_created_series(server: RunningServer) -> None:
    async with httpx.AsyncClient(base_url=server.base_url) as client:
        response = await client.get("/metrics")

    assert "# TYPE streamscope_time_to_first_token_seconds histogram" in response.text
    assert "# TYPE streamscope_generation_tokens_total counter" in response.text
    assert "_created" not in response.text


async def test_the_resume_store_s_writes_reach_stats_and_metrics(server: RunningServer) -> None:
    samples, current = await scrape(server), await stats(server)

    # No shared store in this server: every count is there, and 0 (with one, the
    # registry reports its log's counts, ResumeRegistry.statistics).
    for key in ("pending", "batches", "commands", "failed_batches"):
        assert current[f"resume_store_{key}"] == 0
    assert value(samples, "streamscope_resume_store_pending") == 0
    assert value(samples, "streamscope_resume_store_batches_total") == 0
    assert value(samples, "streamscope_resume_store_failed_batches_total") == 0
