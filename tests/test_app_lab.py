"""The finish-record route, the laboratory padding and the flood probe, over real HTTP.

``GET /v1/requests/<id>`` for a finished, a cancelled, a running and an unknown request;
``STREAMSCOPE_LAB_PAD_BYTES`` padding that parsers skip; ``STREAMSCOPE_LAB_ROUTES``'s
flood, which must report a blocked write to a client that reads nothing and end when
that client goes. Every test ends with the fixture's checks (cache whole, no stream).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

import httpx
import pytest
import trio

from app.lab import BLOCKED_AFTER_S
from app.settings import Settings, SettingsError
from app.sse_body import lab_padding
from tests.http_clients import long_body, parse_sse, parse_sse_with_httpx_sse, stream_body
from tests.http_server import RunningServer, StartServer


async def read_stream(server: RunningServer, body: dict[str, Any]) -> bytes:
    async with server.client() as client, client.stream(
        "POST", "/v1/stream", json=body
    ) as response:
        assert response.status_code == 200
        return b"".join([chunk async for chunk in response.aiter_raw()])


async def get(server: RunningServer, path: str) -> httpx.Response:
    async with server.client() as client:
        return await client.get(path)


# -- GET /v1/requests/<id> ------------------------------------------------------------------


async def test_finish_record_of_a_stream_that_ran_to_its_end(server: RunningServer) -> None:
    before = time.time()
    raw = await read_stream(server, stream_body(max_new_tokens=5, ignore_eos=True))
    start = json.loads(parse_sse(raw)[0].data)

    response = await get(server, f"/v1/requests/{start['id']}")

    record = response.json()
    assert response.status_code == 200
    assert {k: record[k] for k in ("id", "finish_reason", "prompt_tokens", "completion_tokens")} \
        == {"id": start["id"], "finish_reason": "length",
            "prompt_tokens": start["prompt_tokens"], "completion_tokens": 5}
    assert before <= record["finished_at"] <= time.time()
    assert record["error"] is None


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_finish_record_of_a_client_that_left_says_cancelled(
    server: RunningServer, how: str
) -> None:
    client = server.raw_client()
    await client.post("/v1/stream", long_body())
    await client.read_tokens(2)
    closed_at = time.time()
    if how == "fin":
        await client.close_clean()
    else:
        client.close_abort()
    finish = await server.wait_finished(client.request_id())

    record = (await get(server, f"/v1/requests/{client.request_id()}")).json()

    assert record["finish_reason"] == "cancelled"
    assert record["completion_tokens"] == finish.completion_tokens >= 2
    assert record["finished_at"] == finish.finished_at >= closed_at


async def test_unknown_and_running_requests_are_404_not_found(server: RunningServer) -> None:
    client = server.raw_client()
    await client.post("/v1/stream", long_body())
    await client.read_tokens(1)

    running = await get(server, f"/v1/requests/{client.request_id()}")
    unknown = await get(server, "/v1/requests/no-such-request")
    client.close_abort()

    for response in (running, unknown):
        assert response.status_code == 404
        assert response.json()["error"]["type"] == "not_found"


# -- STREAMSCOPE_LAB_PAD_BYTES --------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 2, 3, 100, 65536])
async def test_lab_padding_has_the_size_asked_and_both_parsers_skip_it(size: int) -> None:
    padding = lab_padding(size)
    event = b'event: token\nid: 7\ndata: {"x":1}\n\n'
    replay = httpx.Response(200, headers={"content-type": "text/event-stream"},
                            content=event + padding + event)

    assert len(padding) == size
    assert parse_sse(event + padding + event) == parse_sse(event + event)
    assert len(await parse_sse_with_httpx_sse(replay)) == 2


def test_lab_padding_of_one_byte_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2 bytes"):
        lab_padding(1)


async def test_each_token_event_is_followed_by_a_padding_comment(
    start_server: StartServer,
) -> None:
    server = await start_server(lab_pad_bytes=300)
    body = stream_body(max_new_tokens=4, ignore_eos=True)

    raw = await read_stream(server, body)

    events = parse_sse(raw)
    replay = httpx.Response(200, headers={"content-type": "text/event-stream"}, content=raw)
    theirs = await parse_sse_with_httpx_sse(replay)
    assert [e.event for e in events] == ["start"] + ["token"] * 4 + ["done"]
    assert [(e.event, e.data) for e in theirs] == [(e.event, e.data) for e in events]
    comment = b":" + b"p" * 298 + b"\n"
    assert raw.count(comment) == 4
    # Each padding comes right after a token event (and only there).
    pieces = raw.split(comment)
    assert all(piece.rsplit(b"event: ", 1)[-1].startswith(b"token") for piece in pieces[:-1])


def test_lab_settings_parse_and_refuse_bad_values() -> None:
    settings = Settings.from_env({"STREAMSCOPE_LAB_PAD_BYTES": "65536",
                                  "STREAMSCOPE_LAB_ROUTES": "true"})
    assert (settings.lab_pad_bytes, settings.lab_routes) == (65536, True)
    assert (Settings().lab_pad_bytes, Settings().lab_routes) == (0, False)
    for bad in ("-1", "1", "2000000", "lots"):
        with pytest.raises(SettingsError, match="STREAMSCOPE_LAB_PAD_BYTES"):
            Settings.from_env({"STREAMSCOPE_LAB_PAD_BYTES": bad})


# -- the flood (STREAMSCOPE_LAB_ROUTES) -----------------------------------------------------


class SilentClient:
    """Sends one POST and never reads a byte; leaves with an RST."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.sock = trio.socket.socket(trio.socket.AF_INET, trio.socket.SOCK_STREAM)

    async def post(self, path: str, body: dict[str, Any]) -> None:
        payload = json.dumps(body).encode()
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.server.host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n")
        await self.sock.connect((self.server.host, self.server.port))
        data = head.encode() + payload
        while data:
            data = data[await self.sock.send(data):]

    def close_abort(self) -> None:
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


async def flood_status(server: RunningServer, flood_id: str) -> dict[str, Any]:
    response = await get(server, f"/v1/lab/flood/{flood_id}")
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


async def wait_flood(server: RunningServer, flood_id: str, key: str, value: object) -> dict[
    str, Any
]:
    with trio.fail_after(10):
        while True:
            response = await get(server, f"/v1/lab/flood/{flood_id}")
            if response.status_code == 200 and response.json()[key] == value:
                return dict(response.json())
            await trio.sleep(0.02)


async def test_flood_reports_a_blocked_write_for_a_client_that_reads_nothing(
    start_server: StartServer,
) -> None:
    server = await start_server(lab_routes=True)
    client = SilentClient(server)
    await client.post("/v1/lab/flood", {"id": "f1", "event_bytes": 1024})

    blocked = await wait_flood(server, "f1", "blocked", True)
    await trio.sleep(2 * BLOCKED_AFTER_S)
    later = await flood_status(server, "f1")

    assert blocked["state"] == "open"
    assert blocked["bytes_accepted"] > 0
    assert blocked["bytes_accepted"] == 1024 * blocked["events_accepted"]
    assert later["bytes_accepted"] == blocked["bytes_accepted"]  # nothing more went out
    assert later["last_accept_age_s"] >= 2 * BLOCKED_AFTER_S
    assert later["bytes_pending"] == 1024

    client.close_abort()
    ended = await wait_flood(server, "f1", "state", "ended")
    assert (ended["end"], ended["blocked"]) == ("cancelled", False)


async def test_flood_to_a_client_that_leaves_while_reading_is_released(
    start_server: StartServer,
) -> None:
    server = await start_server(lab_routes=True)
    async with server.client() as client, client.stream(
        "POST", "/v1/lab/flood", json={"id": "f2", "event_bytes": 133}
    ) as response:
        assert response.headers["x-flood-id"] == "f2"
        async for _ in response.aiter_raw():
            break  # read one chunk, then leave

    ended = await wait_flood(server, "f2", "state", "ended")
    assert ended["end"] == "cancelled"
    assert ended["events_accepted"] > 0


async def test_flood_ends_at_its_byte_bound(start_server: StartServer) -> None:
    server = await start_server(lab_routes=True)
    async with server.client() as client:
        response = await client.post(
            "/v1/lab/flood", json={"id": "f3", "event_bytes": 100, "max_bytes": 1050}
        )

    status = await flood_status(server, "f3")
    assert response.content == (b"data: " + b"f" * 92 + b"\n\n") * 10
    assert (status["state"], status["end"], status["bytes_accepted"]) == ("ended", "max_bytes",
                                                                          1000)


async def test_flood_refuses_a_bad_request(start_server: StartServer) -> None:
    server = await start_server(lab_routes=True)
    async with server.client() as client:
        too_small = await client.post("/v1/lab/flood", json={"event_bytes": 4})
        bad_id = await client.post("/v1/lab/flood", json={"id": "a/b", "event_bytes": 100})
        unknown = await client.get("/v1/lab/flood/nothing")

    assert [r.status_code for r in (too_small, bad_id, unknown)] == [422, 422, 404]
    assert unknown.json()["error"]["type"] == "not_found"


async def test_lab_routes_are_absent_unless_enabled(server: RunningServer) -> None:
    async with server.client() as client:
        response = await client.post("/v1/lab/flood", json={"event_bytes": 100})

    assert response.status_code == 404
