"""The lab's server (``tools/lab/_app.py``) over real HTTP, and the service without it.

``GET /v1/requests/<id>`` (the service's) and ``GET /v1/lab/requests/<id>`` (the lab's,
with the wall-clock ``finished_at``) for a finished, a cancelled, a running and an
unknown request; ``STREAMSCOPE_LAB_PAD_BYTES`` padding that parsers skip; the flood,
which must report a blocked write to a client that reads nothing and end when that
client goes; ``STREAMSCOPE_LAB_DETECT_DISCONNECT=false``. The service has none of them
and refuses the lab's variables. Every test ends with the fixture's checks (cache whole,
no stream).
"""

from __future__ import annotations

import json
import socket
import struct
import time
from functools import partial
from typing import Any

import httpx
import pytest
import trio

from app.settings import Settings, SettingsError
from engine import FinishReason
from tests.http_clients import long_body, parse_sse, parse_sse_with_httpx_sse, stream_body
from tests.http_server import RunningServer, StartServer
from tools.lab._app import create_lab_app
from tools.lab._flood import BLOCKED_AFTER_S
from tools.lab._settings import LabSettings, LabSettingsError, lab_padding, split_lab_environ


async def start_lab(start_server: StartServer, **lab: Any) -> RunningServer:
    return await start_server(create=partial(create_lab_app, lab=LabSettings(**lab)))


async def read_stream(server: RunningServer, body: dict[str, Any]) -> bytes:
    async with server.client() as client, client.stream(
        "POST", "/v1/stream", json=body
    ) as response:
        assert response.status_code == 200
        return b"".join([chunk async for chunk in response.aiter_raw()])


async def get(server: RunningServer, path: str) -> httpx.Response:
    async with server.client() as client:
        return await client.get(path)


# -- GET /v1/requests/<id>, and the lab's with finished_at ---------------------------------


async def test_finish_record_of_a_stream_that_ran_to_its_end(start_server: StartServer) -> None:
    server = await start_lab(start_server)
    before = time.time()
    raw = await read_stream(server, stream_body(max_new_tokens=5, ignore_eos=True))
    start = json.loads(parse_sse(raw)[0].data)

    service = await get(server, f"/v1/requests/{start['id']}")
    lab = await get(server, f"/v1/lab/requests/{start['id']}")

    record = service.json()
    assert service.status_code == lab.status_code == 200
    assert record == {"id": start["id"], "finish_reason": "length", "error": None,
                      "prompt_tokens": start["prompt_tokens"], "completion_tokens": 5,
                      "cached_tokens": 0}
    assert lab.json() == {**record, "finished_at": lab.json()["finished_at"]}
    assert before <= lab.json()["finished_at"] <= time.time()


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_finish_record_of_a_client_that_left_says_cancelled(
    start_server: StartServer, how: str
) -> None:
    server = await start_lab(start_server)
    client = server.raw_client()
    await client.post("/v1/stream", long_body())
    await client.read_tokens(2)
    server.recorder.hold()  # it cannot end on its own before the server notices the close
    closed_at = time.time()
    if how == "fin":
        await client.close_clean()
    else:
        client.close_abort()
    await server.wait_for(lambda: client.request_id() in server.recorder.cancel_marks,
                          "the cancel")
    server.recorder.release()
    finish = await server.wait_finished(client.request_id())

    record = (await get(server, f"/v1/lab/requests/{client.request_id()}")).json()

    assert record["finish_reason"] == "cancelled"
    assert record["completion_tokens"] == finish.completion_tokens >= 2
    assert closed_at <= record["finished_at"] <= time.time()


async def test_unknown_and_running_requests_are_404_not_found(
    start_server: StartServer,
) -> None:
    server = await start_lab(start_server)
    client = server.raw_client()
    await client.post("/v1/stream", long_body())
    await client.read_tokens(1)
    server.recorder.hold()  # still running while it is asked about

    answers = [await get(server, f"{prefix}/requests/{request_id}")
               for prefix in ("/v1", "/v1/lab")
               for request_id in (client.request_id(), "no-such-request")]
    server.recorder.release()
    client.close_abort()

    for response in answers:
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
    server = await start_lab(start_server, pad_bytes=300)
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


def test_lab_settings_parse_refuse_bad_values_and_leave_the_environment() -> None:
    environ = {"STREAMSCOPE_LAB_PAD_BYTES": "65536", "STREAMSCOPE_LAB_DETECT_DISCONNECT": "off",
               "STREAMSCOPE_MAX_BATCH": "4"}

    given = dict(environ)
    lab, rest = split_lab_environ(environ)
    assert lab == LabSettings(pad_bytes=65536, detect_disconnect=False)
    assert rest == {"STREAMSCOPE_MAX_BATCH": "4"}  # what the service then reads
    assert environ == given
    assert LabSettings.from_env({}) == LabSettings(pad_bytes=0, detect_disconnect=True)
    for bad in ("-1", "1", "2000000", "lots"):
        with pytest.raises(LabSettingsError, match="STREAMSCOPE_LAB_PAD_BYTES"):
            LabSettings.from_env({"STREAMSCOPE_LAB_PAD_BYTES": bad})
    with pytest.raises(LabSettingsError, match="known: STREAMSCOPE_LAB_DETECT_DISCONNECT"):
        LabSettings.from_env({"STREAMSCOPE_LAB_ROUTES": "true"})


@pytest.mark.parametrize("name", ["STREAMSCOPE_LAB_PAD_BYTES", "STREAMSCOPE_DETECT_DISCONNECT",
                                  "STREAMSCOPE_LAB_ROUTES", "STREAMSCOPE_LAB_DETECT_DISCONNECT"])
def test_the_service_refuses_the_lab_variables(name: str) -> None:
    with pytest.raises(SettingsError, match=f"{name} is not a setting"):
        Settings.from_env({name: "1"})


# -- STREAMSCOPE_LAB_DETECT_DISCONNECT ------------------------------------------------------


async def test_without_disconnect_detection_a_left_stream_runs_to_its_end(
    start_server: StartServer,
) -> None:
    server = await start_lab(start_server, detect_disconnect=False)
    client = server.raw_client()
    await client.post("/v1/stream", stream_body(max_new_tokens=60, ignore_eos=True))
    await client.read_tokens(2)

    client.close_abort()
    finish = await server.wait_finished(client.request_id())

    assert (finish.reason, finish.completion_tokens) == (FinishReason.LENGTH, 60)
    assert client.request_id() not in server.recorder.cancel_marks


# -- the flood ------------------------------------------------------------------------------


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
    server = await start_lab(start_server)
    client = SilentClient(server)
    await client.post("/v1/lab/flood", {"id": "f1", "event_bytes": 1024})

    blocked = await wait_flood(server, "f1", "blocked", True)
    # Time must pass for "nothing more went out" to mean anything: there is no event for
    # a write that does not happen. The client never reads, so the write stays blocked
    # however long this is, on any machine.
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
    server = await start_lab(start_server)
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
    server = await start_lab(start_server)
    async with server.client() as client:
        response = await client.post(
            "/v1/lab/flood", json={"id": "f3", "event_bytes": 100, "max_bytes": 1050}
        )

    status = await flood_status(server, "f3")
    assert response.content == (b"data: " + b"f" * 92 + b"\n\n") * 10
    assert (status["state"], status["end"], status["bytes_accepted"]) == ("ended", "max_bytes",
                                                                          1000)


async def test_flood_refuses_a_bad_request(start_server: StartServer) -> None:
    server = await start_lab(start_server)
    async with server.client() as client:
        too_small = await client.post("/v1/lab/flood", json={"event_bytes": 4})
        bad_id = await client.post("/v1/lab/flood", json={"id": "a/b", "event_bytes": 100})
        unknown = await client.get("/v1/lab/flood/nothing")

    assert [r.status_code for r in (too_small, bad_id, unknown)] == [422, 422, 404]
    assert unknown.json()["error"]["type"] == "not_found"


async def test_the_service_has_no_lab_routes_and_no_padding(server: RunningServer) -> None:
    async with server.client() as client:
        flood = await client.post("/v1/lab/flood", json={"event_bytes": 100})
    raw = await read_stream(server, stream_body(max_new_tokens=3, ignore_eos=True))
    lab_record = await get(server, f"/v1/lab/requests/{json.loads(parse_sse(raw)[0].data)['id']}")

    assert flood.status_code == lab_record.status_code == 404
    assert b"\n:" not in raw
