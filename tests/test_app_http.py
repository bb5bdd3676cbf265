"""The app over real HTTP: a real hypercorn on a loopback port, httpx on Trio, tiny model.

Event order and ids, headers, agreement of two SSE parsers, /v1/generate against
/v1/stream, stop strings, keep-alive, health, readiness and statistics. Every test ends
with the fixture's checks: no stream open, cache whole, releases == admitted.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import trio

from streams import ServerSentEvent
from tests.http_clients import long_body, parse_sse, parse_sse_with_httpx_sse, stream_body
from tests.http_server import RunningServer, StartServer


async def post_stream(server: RunningServer, body: dict[str, Any]) -> tuple[
    httpx.Response, bytes, list[ServerSentEvent]
]:
    """POST /v1/stream; return the response, its raw body, and httpx-sse's events."""
    async with server.client() as client, client.stream(
        "POST", "/v1/stream", json=body
    ) as response:
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    # httpx-sse reads from a response; give it a finished one with the same bytes.
    replay = httpx.Response(200, headers=response.headers, content=raw)
    return response, raw, await parse_sse_with_httpx_sse(replay)


async def test_stream_sends_start_tokens_done_with_ids_from_one(server: RunningServer) -> None:
    response, raw, _ = await post_stream(server, stream_body(max_new_tokens=6))

    events = parse_sse(raw)
    assert [e.event for e in events] == ["start"] + ["token"] * 6 + ["done"]
    assert [e.id for e in events] == [str(i) for i in range(1, 9)]
    start = json.loads(events[0].data)
    assert [json.loads(e.data)["index"] for e in events[1:-1]] == list(range(6))
    assert json.loads(events[-1].data) == {
        "finish_reason": "length",
        "usage": {"prompt_tokens": start["prompt_tokens"], "completion_tokens": 6,
                  "cached_tokens": 0},
    }
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-request-id"] == start["id"]
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["x-accel-buffering"] == "no"


async def test_our_parser_and_httpx_sse_read_the_same_events(server: RunningServer) -> None:
    _, raw, theirs = await post_stream(server, stream_body(max_new_tokens=12))

    ours = parse_sse(raw)
    assert len(ours) == 14
    assert [(e.event, e.id, e.data) for e in ours] == [(e.event, e.id, e.data) for e in theirs]


async def test_generate_returns_the_tokens_the_stream_sent(server: RunningServer) -> None:
    body = stream_body(max_new_tokens=10)
    _, raw, _ = await post_stream(server, body)
    async with server.client() as client:
        response = await client.post("/v1/generate", json=body)

    events = parse_sse(raw)
    tokens = [json.loads(e.data) for e in events if e.event == "token"]
    answer = response.json()
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-request-id"] == answer["id"]
    assert answer["tokens"] == [t["id"] for t in tokens]
    assert answer["text"] == "".join(t["text"] for t in tokens)
    assert (answer["finish_reason"], answer["usage"]) == (
        "length", json.loads(events[-1].data)["usage"]
    )


async def test_stop_string_ends_the_stream_with_finish_reason_stop(
    server: RunningServer,
) -> None:
    async with server.client() as client:
        free = (await client.post("/v1/generate", json=stream_body(max_new_tokens=40))).json()
    text = free["text"]
    # Two ASCII letters the greedy continuation is known to produce, not at its start.
    at = next(i for i in range(1, len(text) - 1) if text[i:i + 2].isascii()
              and text[i:i + 2].isalpha())
    stop = text[at:at + 2]

    _, raw, _ = await post_stream(server, stream_body(max_new_tokens=40, stop=[stop]))

    events = parse_sse(raw)
    streamed = "".join(json.loads(e.data)["text"] for e in events if e.event == "token")
    assert json.loads(events[-1].data)["finish_reason"] == "stop"
    assert streamed == text[:text.index(stop)]


async def read_across_a_keepalive(
    server: RunningServer, body: dict[str, Any]
) -> tuple[httpx.Response, bytes]:
    """POST /v1/stream while the engine's next step is held, so the stream has nothing to
    send; read until a keep-alive came (more than keepalive_s passed), release the step,
    and read to the end. Returns the response and its raw body."""
    server.recorder.hold()
    async with server.client() as client, client.stream(
        "POST", "/v1/stream", json=body
    ) as response:
        raw, chunks = b"", response.aiter_raw()
        async for chunk in chunks:
            raw += chunk
            if b": keep-alive\n" in raw:
                break
        server.recorder.release()
        async for chunk in chunks:
            raw += chunk
    return response, raw


async def test_idle_stream_gets_a_keepalive_comment(start_server: StartServer) -> None:
    server = await start_server(keepalive_s=0.05)

    response, raw = await read_across_a_keepalive(server, stream_body(max_new_tokens=2))

    events = parse_sse(raw)
    assert [e.event for e in events] == ["start", "token", "token", "done"]
    assert raw.index(b": keep-alive\n") < raw.index(b"event: token")
    replay = httpx.Response(200, headers=response.headers, content=raw)
    theirs = await parse_sse_with_httpx_sse(replay)  # no spurious event at the keep-alive
    assert [(e.event, e.id, e.data) for e in theirs] == [(e.event, e.id, e.data) for e in events]


async def test_health_ready_and_stats_when_ready(server: RunningServer) -> None:
    async with server.client() as client:
        health, ready, stats = [await client.get(p) for p in ("/health", "/ready", "/stats")]

    assert (health.status_code, ready.status_code, stats.status_code) == (200, 200, 200)
    numbers = stats.json()
    for name in ("blocks_total", "blocks_free", "running", "waiting", "paused",
                 "streams_open", "releases", "events_dropped", "slow_client_drops"):
        assert isinstance(numbers[name], int), name
    assert numbers["blocks_total"] == numbers["blocks_free"] == 64
    assert (numbers["model"], numbers["device"], numbers["phase"]) == ("tiny-gpt2", "cpu", "ready")


async def test_health_answers_while_the_model_loads(start_server: StartServer) -> None:
    import threading

    load_gate = threading.Event()
    server = await start_server(load_gate=load_gate, wait_ready=False)
    try:
        async with server.client() as client:
            health, ready = await client.get("/health"), await client.get("/ready")
    finally:
        load_gate.set()

    assert health.status_code == 200
    assert health.json()["phase"] == "loading"
    assert ready.status_code == 503
    assert ready.json() == {
        "error": {"type": "not_ready", "message": "the model is still loading"}
    }
    with trio.fail_after(10):
        await server.app.runtime.loading_outcome()


async def test_engine_failure_after_the_first_byte_is_an_error_event(
    server: RunningServer,
) -> None:
    client = server.raw_client()
    await client.post("/v1/stream", long_body())
    await client.read_tokens(2)

    # At once after the read: the engine is a few steps ahead of it, far from 480.
    server.recorder.fail(client.request_id())
    await client.read_until(lambda events: events[-1].event == "error")
    await client.read_to_end()

    error = json.loads(client.events[-1].data)["error"]
    assert (error["type"], error["message"]) == ("engine_error", "scripted failure")
    assert client.response is not None
    assert client.response.status_code == 200


async def test_engine_failure_in_generate_is_a_500_engine_error(server: RunningServer) -> None:
    async with server.client() as client, trio.open_nursery() as nursery:
        async def fail_when_running() -> None:
            recorder = server.recorder
            await server.wait_for(lambda: any(map(recorder.token_ids_of, recorder.submitted)),
                                  "the request running")
            # A poll (5 ms) after its first token: tens of its 480 steps on a machine 5x
            # faster, at most.
            recorder.fail(recorder.submitted[0])

        nursery.start_soon(fail_when_running)
        response = await client.post("/v1/generate", json=long_body())

    assert response.status_code == 500
    assert response.json() == {"error": {"type": "engine_error", "message": "scripted failure"}}


async def test_quarts_response_timeout_does_not_cut_a_stream(start_server: StartServer) -> None:
    server = await start_server(keepalive_s=0.05)
    server.app.config["RESPONSE_TIMEOUT"] = 0.01  # Quart's default is 60 s

    _, raw = await read_across_a_keepalive(server, stream_body(max_new_tokens=3))

    assert [e.event for e in parse_sse(raw)] == ["start", "token", "token", "token", "done"]
