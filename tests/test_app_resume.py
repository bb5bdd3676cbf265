"""Resumable streams over real HTTP (issue 9, section 2): ids, resume, grace, DELETE, limits.

The wire contract is in ``app/routes/resumable.py``'s docstring. A client "drops" after k
events by resetting its connection (RST) and counts only the first k events it parsed as
received; the test waits until the server noticed (the stream is detached) before it
resumes (a resume while the first reader is attached takes the stream over: tested
on its own).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from engine import FinishReason
from streams import ServerSentEvent, SSEParser
from streams.resume import Holding
from streams.resume.reader import TAKEOVER_WAIT_S
from tests.http_clients import RawClient, long_body, stream_body
from tests.http_server import RunningServer, StartServer

SHORT_TOKENS = 12  # a short greedy stream: 14 events (start, 12 tokens, done)


def short_body(**fields: Any) -> dict[str, Any]:
    return stream_body(max_new_tokens=SHORT_TOKENS, ignore_eos=True, **fields)


def token_ids(events: list[ServerSentEvent]) -> list[int]:
    return [json.loads(e.data)["id"] for e in events if e.event == "token"]


def positions(events: list[ServerSentEvent], request_id: str) -> list[int]:
    """Each event's n, checking that its id names the stream."""
    result = []
    for e in events:
        assert e.id is not None
        stream_id, _, n = e.id.rpartition(":")
        assert stream_id == request_id
        result.append(int(n))
    return result


async def resume(
    server: RunningServer, request_id: str, last_event_id: str | None = None, *,
    query: str = "",
) -> tuple[httpx.Response, bytes]:
    """GET the resume route and read the whole body."""
    headers = {} if last_event_id is None else {"Last-Event-ID": last_event_id}
    async with server.client() as client:
        response = await client.get(f"/v1/stream/{request_id}{query}", headers=headers)
    return response, response.content


def parse(raw: bytes) -> list[ServerSentEvent]:
    parser = SSEParser()
    return parser.feed(raw) + parser.close()


async def wait_detached(server: RunningServer, request_id: str) -> None:
    """Until the server noticed the reader left: the registry holds the stream."""
    registry = server.app.runtime.resumption
    assert registry is not None
    await server.wait_for(lambda: registry.holding(request_id) is Holding.DETACHED,
                          f"{request_id} detached")


async def open_resumable(server: RunningServer, body: dict[str, Any]) -> RawClient:
    client = server.raw_client()
    await client.post("/v1/stream", {**body, "resumable": True})
    return client


async def test_resumable_ids_name_the_stream_and_the_response_says_where_to_resume(
    server: RunningServer,
) -> None:
    async with server.client() as client:
        response = await client.post("/v1/stream", json=short_body(resumable=True))
    events = parse(response.content)
    request_id = response.headers["X-Request-ID"]

    assert response.headers["X-Resume-URL"] == f"/v1/stream/{request_id}"
    assert positions(events, request_id) == list(range(1, SHORT_TOKENS + 3))
    assert [e.event for e in events] == ["start"] + ["token"] * SHORT_TOKENS + ["done"]


async def test_reconnecting_at_every_position_reassembles_the_uninterrupted_stream(
    server: RunningServer,
) -> None:
    async with server.client() as client:
        whole = parse((await client.post("/v1/stream", json=short_body())).content)
    expected = token_ids(whole)
    num_events = len(whole)
    assert len(expected) == SHORT_TOKENS

    for k in range(num_events):  # drop after k events; k = num_events is the 204 test's
        first = await open_resumable(server, short_body())
        await first.read_until(lambda events, k=k: len(events) >= max(k, 1))
        request_id = first.request_id()
        received = first.events[:k]
        first.close_abort()
        await wait_detached(server, request_id)

        response, raw = await resume(server, request_id, f"{request_id}:{k}")
        rest = parse(raw)

        assert response.status_code == 200, (k, raw)
        assert raw.startswith(b"retry: 1000\n")
        assert positions(received + rest, request_id) == list(range(1, num_events + 1)), k
        assert token_ids(received + rest) == expected, k
        assert rest[-1].event == "done"


async def test_a_created_request_is_read_from_the_start_by_get(server: RunningServer) -> None:
    async with server.client() as client:
        created = await client.post("/v1/requests", json=short_body())
    request_id = created.json()["id"]
    assert created.status_code == 201
    assert created.json()["stream_url"] == created.headers["Location"] == \
        f"/v1/stream/{request_id}"

    response, raw = await resume(server, request_id)
    events = parse(raw)

    assert response.headers["content-type"].startswith("text/event-stream")
    assert positions(events, request_id) == list(range(1, SHORT_TOKENS + 3))
    assert token_ids(events) == server.recorder.token_ids_of(request_id)


async def test_query_last_event_id_resumes_and_the_header_wins(server: RunningServer) -> None:
    async with server.client() as client:
        request_id = (await client.post("/v1/requests", json=short_body())).json()["id"]
    await server.wait_finished(request_id)

    _, by_query = await resume(server, request_id, query=f"?last_event_id={request_id}:10")
    _, both = await resume(server, request_id, f"{request_id}:12",
                           query=f"?last_event_id={request_id}:3")

    assert positions(parse(by_query), request_id) == [11, 12, 13, 14]
    assert positions(parse(both), request_id) == [13, 14]


async def test_finished_stream_read_to_its_end_or_unknown_id_gets_204(
    server: RunningServer,
) -> None:
    async with server.client() as client:
        response = await client.post("/v1/stream", json=short_body(resumable=True))
    request_id = response.headers["X-Request-ID"]
    last = parse(response.content)[-1].id
    await wait_detached(server, request_id)

    done, done_body = await resume(server, request_id, last)
    unknown, _ = await resume(server, "0123456789abcdef", None)

    assert (done.status_code, done_body) == (204, b"")
    assert unknown.status_code == 204


@pytest.mark.parametrize(("last_event_id", "status", "error_type"), [
    ("someoneelse:3", 400, "bad_request"),
    ("no-colon", 422, "invalid_request"),
    ("{id}:x", 422, "invalid_request"),
    ("{id}:99", 422, "invalid_request"),  # past the last event made
])
async def test_bad_last_event_id_is_refused_with_the_envelope(
    server: RunningServer, last_event_id: str, status: int, error_type: str,
) -> None:
    async with server.client() as client:
        request_id = (await client.post("/v1/requests", json=short_body())).json()["id"]
    await server.wait_finished(request_id)

    response, _ = await resume(server, request_id, last_event_id.format(id=request_id))

    assert response.status_code == status
    assert response.json()["error"]["type"] == error_type


async def read_events(response: httpx.Response, count: int) -> list[ServerSentEvent]:
    """The first ``count`` events of a streamed response (iterating its body)."""
    parser, events = SSEParser(), []
    async for chunk in response.aiter_bytes():
        events += parser.feed(chunk)
        if len(events) >= count:
            break
    return events[:count]


async def test_a_second_reader_takes_over_a_silently_dead_first_at_once(
    server: RunningServer,
) -> None:
    """The first client stops reading and never closes (no FIN, no RST: a phone that
    changed networks): the server cannot know it is gone. A second reader takes the
    stream over at once; the first gets no more events, and its body ends with an
    ``error`` event ``taken_over`` (no id: it is not part of the stream)."""
    first = await open_resumable(server, long_body())
    await first.read_tokens(2)  # from now on it reads nothing and stays open
    # Held until the takeover: the first can get only what the engine made by now (a few
    # steps ahead of the reader at most), so fewer than k + 10 events, on any machine.
    server.recorder.hold()
    request_id = first.request_id()
    k = len(first.events)

    # At once: in milliseconds, where a takeover whose old reader did not let go waits
    # TAKEOVER_WAIT_S (5 s) before its 409.
    with trio.fail_after(TAKEOVER_WAIT_S / 2):
        async with server.client() as client, client.stream(
            "GET", f"/v1/stream/{request_id}", headers={"Last-Event-ID": f"{request_id}:{k}"}
        ) as second:
            status = second.status_code  # the head: the stream is the second's now
            server.recorder.release()
            taken = await read_events(second, 10) if status == 200 else []
    async with server.client() as client:
        deleted = await client.delete(f"/v1/requests/{request_id}")
    await first.read_to_end()  # what the server wrote to the first, all buffered
    first.sock.close()

    assert status == 200
    assert positions(taken, request_id) == list(range(k + 1, k + 11))  # none twice or skipped
    assert token_ids(taken) == server.recorder.token_ids_of(request_id)[k - 1:k + 9]
    numbered, last = first.events[:-1], first.events[-1]
    assert positions(numbered, request_id) == list(range(1, len(numbered) + 1))
    assert len(numbered) < k + 10  # it stopped receiving while the second read on
    assert (last.event, last.id) == ("error", numbered[-1].id)  # no id of its own
    assert json.loads(last.data)["error"]["type"] == "taken_over"
    assert deleted.status_code == 204
    finish = await server.wait_finished(request_id)
    assert finish.reason is FinishReason.CANCELLED


async def test_delete_ends_a_detached_stream_at_once(server: RunningServer) -> None:
    async with server.client() as client:
        request_id = (await client.post("/v1/requests", json=long_body())).json()["id"]
        await server.wait_for(lambda: len(server.recorder.token_ids_of(request_id)) >= 2,
                              "tokens generated with no reader")
        server.recorder.hold()  # it cannot end on its own before the DELETE
        deleted = await client.delete(f"/v1/requests/{request_id}")
        again = await client.delete(f"/v1/requests/{request_id}")
        server.recorder.release()
    finish = await server.wait_finished(request_id)
    gone, _ = await resume(server, request_id)

    assert (deleted.status_code, again.status_code, gone.status_code) == (204, 404, 204)
    assert finish.reason is FinishReason.CANCELLED
    assert server.recorder.statistics().releases == 1


async def test_grace_expiry_cancels_the_stream_and_releases_its_blocks_once(
    start_server: StartServer,
) -> None:
    # The grace period is the server's (Trio's) timer; the stream must outlive it on any
    # machine. So once generation is seen going on with no reader, the engine's steps are
    # held: the stream cannot reach its token limit, however fast the machine, and the
    # expiry's cancel waits for the next step boundary. 2 s of grace leaves a machine 5x
    # slower than this one (a few ms a token for the tiny model) time for the 5 tokens
    # before it.
    server = await start_server(resume_grace_s=2.0)
    first = await open_resumable(server, long_body())
    await first.read_tokens(2)
    request_id = first.request_id()
    first.close_abort()
    await wait_detached(server, request_id)
    at_detach = len(server.recorder.token_ids_of(request_id))
    await server.wait_for(lambda: len(server.recorder.token_ids_of(request_id)) >= at_detach + 5,
                          "generation going on with no reader")
    server.recorder.hold()
    assert server.recorder.finish_of(request_id) is None  # not cancelled at once
    await server.wait_for(lambda: server.app.runtime.statistics()["resume_expiries"] == 1,
                          "the grace period to expire")
    assert server.recorder.finish_of(request_id) is None  # held: not finished meanwhile
    server.recorder.release()

    finish = await server.wait_finished(request_id)
    gone, _ = await resume(server, request_id, f"{request_id}:3")

    assert finish.reason is FinishReason.CANCELLED
    assert gone.status_code == 204
    stats = server.app.runtime.statistics()
    assert (stats["resume_expiries"], stats["resumable_streams"]) == (1, 0)
    assert server.recorder.statistics().releases == 1


async def test_detached_stream_over_the_byte_cap_ends_with_an_error_event(
    start_server: StartServer,
) -> None:
    server = await start_server(resume_max_bytes=2000)
    async with server.client() as client:
        request_id = (await client.post("/v1/requests", json=long_body())).json()["id"]
    finish = await server.wait_finished(request_id)
    _, raw = await resume(server, request_id)
    events = parse(raw)

    assert finish.reason is FinishReason.CANCELLED
    assert events[-1].event == "error"
    assert json.loads(events[-1].data)["error"]["type"] == "resume_log_full"
    assert len(raw) < 2000 + 400  # the cap, the retry line and the one error event
    stats = server.app.runtime.statistics()
    assert stats["resume_overflows"] == 1


async def test_stats_and_metrics_show_resumable_streams(server: RunningServer) -> None:
    async with server.client() as client:
        request_id = (await client.post("/v1/requests", json=long_body())).json()["id"]
        server.recorder.hold()  # still running, detached, while it is looked at
        await wait_detached(server, request_id)
        stats = (await client.get("/stats")).json()
        metrics = (await client.get("/metrics")).text
        await client.delete(f"/v1/requests/{request_id}")
        server.recorder.release()
    await server.wait_finished(request_id)

    assert stats["resumable_detached"] == 1
    assert stats["resume_detached_bytes"] == stats["resume_log_bytes"] > 0
    assert "streamscope_resumable_streams_detached 1.0" in metrics
    assert "streamscope_resume_expiries_total 0.0" in metrics


async def test_plain_stream_ids_are_unchanged(server: RunningServer) -> None:
    async with server.client() as client:
        response = await client.post("/v1/stream", json=short_body())

    assert [e.id for e in parse(response.content)] == [str(n) for n in range(1, 15)]
    assert "X-Resume-URL" not in response.headers
