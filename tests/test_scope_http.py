"""The scope over real HTTP (hypercorn on loopback, the tiny model): a client that leaves
is a row ending ``cancelled`` and its blocks come back; the feed is protected like
``/stats`` and a key holder sees its own streams only; a slow watcher never holds the
engine up."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from app.wire.scope_events import SHORT_ID
from streams import ServerSentEvent, SSEParser
from tests.http_clients import long_body, stream_body
from tests.http_server import SETTLE_TIMEOUT_S, RunningServer, StartServer

OPS_KEY = "o" * 32
ALICE_KEY = "a" * 32
BOB_KEY = "b" * 32
MAX_STREAMS = 40  # streams made while a watcher reads nothing, at most
KEYS = [{"name": "ops", "key": OPS_KEY}, {"name": "alice", "key": ALICE_KEY},
        {"name": "bob", "key": BOB_KEY}]


class Feed:
    """An open ``/scope/events`` response, parsed as it arrives."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self.parser = SSEParser()
        self.events: list[ServerSentEvent] = []
        self._chunks = response.aiter_bytes()

    async def until(self, condition: Callable[[], bool], what: str) -> None:
        try:
            with trio.fail_after(SETTLE_TIMEOUT_S):
                while not condition():
                    self.events += self.parser.feed(await self._chunks.__anext__())
        except trio.TooSlowError:
            raise AssertionError(f"the feed never showed {what}") from None

    def frames(self) -> list[dict[str, Any]]:
        return [json.loads(e.data) for e in self.events if e.event in ("snapshot", "frame")]

    def rows(self, request_id: str) -> list[dict[str, Any]]:
        return [r for f in self.frames() for r in f["rows"] if r["id"] == request_id[:SHORT_ID]]

    def key_names(self) -> set[str | None]:
        return {r["key"] for f in self.frames() for r in f["rows"]}

    def moments(self, kind: str) -> list[dict[str, Any]]:
        return [m for f in self.frames() for m in f["moments"] if m["kind"] == kind]


@asynccontextmanager
async def open_feed(client: httpx.AsyncClient, url: str = "/scope/events",
                    **headers: str) -> AsyncIterator[Feed]:
    async with client.stream("GET", url, headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        yield Feed(response)


async def test_a_client_that_leaves_ends_cancelled_on_the_feed_and_its_blocks_return(
    server: RunningServer,
) -> None:
    async with server.client() as client, open_feed(client) as feed:
        await feed.until(lambda: bool(feed.frames()), "its snapshot")
        assert feed.events[0].event == "snapshot"
        raw = server.raw_client()
        await raw.post("/v1/stream", long_body())
        await raw.read_tokens(3)
        request_id = raw.request_id()
        await feed.until(lambda: any(r["state"] == "running" for r in feed.rows(request_id)),
                         "the stream running")
        raw.close_abort()  # RST: the client is gone

        def released() -> bool:
            rows = feed.rows(request_id)
            return bool(rows) and rows[-1]["state"] == "cancelled" and rows[-1]["released"]

        await feed.until(released, "the row cancelled with its blocks back")
        [moment] = [m for m in feed.moments("disconnect") if m["id"] == request_id[:SHORT_ID]]
        assert moment["steps"] >= 1 and moment["ms"] >= 0
        await feed.until(lambda: feed.frames()[-1]["pool"]["free"]
                         == feed.frames()[-1]["pool"]["total"], "every block free")
        assert all(r["key"] is None and "text" not in r for r in feed.rows(request_id))
    finish = await server.wait_finished(request_id)
    assert finish.reason.value == "cancelled"


async def test_the_feed_needs_a_key_and_a_key_holder_sees_its_own_streams(
    start_server: StartServer,
) -> None:
    server = await start_server(api_keys=KEYS, scope_operator_keys=frozenset({"ops"}))
    async with server.client() as client:
        assert (await client.get("/scope")).status_code == 200  # the page holds no data
        assert (await client.get("/scope.js")).status_code == 200
        refused = await client.get("/scope/events")
        assert refused.status_code == 401
        assert refused.json()["error"]["type"] == "unauthorized"
        assert (await client.get("/scope/events?token=1.abc")).status_code == 401
        assert (await client.get("/scope/token")).status_code == 401
        alice = {"Authorization": f"Bearer {ALICE_KEY}"}
        where = (await client.get("/scope/token", headers=alice)).json()
        assert (where["key"], where["sees_all"]) == ("alice", False)
        assert where["events_url"].startswith("/scope/events?token=")
        # the feed's read token opens nothing else
        other = await client.get("/v1/stream/x" + where["events_url"][len("/scope/events"):])
        assert other.status_code == 401

        async with open_feed(client, where["events_url"]) as alices, \
                open_feed(client, Authorization=f"Bearer {OPS_KEY}") as ops:
            bob = {"Authorization": f"Bearer {BOB_KEY}"}
            for headers in (alice, bob):
                answer = await client.post("/v1/stream", headers=headers,
                                           json=stream_body(max_new_tokens=4))
                assert answer.status_code == 200
            def bob_ended() -> list[float]:
                return [f["t"] for f in ops.frames() for r in f["rows"]
                        if r["key"] == "bob" and r["state"] == "length"]

            await ops.until(lambda: bool(bob_ended()), "bob's stream ended")
            assert "alice" in ops.key_names()  # the operator sees every stream
            # alice's feed went on at least as long as bob's stream: it never showed it
            await alices.until(lambda: any(f["t"] >= bob_ended()[0] for f in alices.frames()),
                               "alice's feed past bob's stream")
            assert alices.key_names() == {"alice"}


async def test_a_watcher_that_does_not_read_never_holds_the_engine_up(
    start_server: StartServer,
) -> None:
    server = await start_server(queue_limit=2, stall_timeout_s=0.2)
    stalled = server.raw_client()  # sends its request, then reads nothing
    stalled.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await stalled.sock.connect((stalled.host, stalled.port))
    await stalled.sock.send(b"GET /scope/events HTTP/1.1\r\nHost: localhost\r\n\r\n")
    await server.wait_for(lambda: server.hub.scope.watchers == 1, "the watcher")
    async with server.client() as client:
        for _ in range(MAX_STREAMS):  # until the socket is full and the policy drops it
            if not server.hub.scope.watchers:
                break
            answer = await client.post("/v1/stream", json=stream_body(max_new_tokens=64,
                                                                      ignore_eos=True))
            assert answer.status_code == 200  # the engine went on: every stream ends
            assert json.loads(answer.text.rstrip().rpartition("data: ")[2])["usage"][
                "completion_tokens"] == 64
    assert server.hub.scope.watchers == 0 and not server.hub.scope.watched
    stalled.close_abort()


async def test_a_rows_text_is_there_only_when_the_operator_turns_it_on(
    start_server: StartServer,
) -> None:
    server = await start_server(scope_show_text=True)
    async with server.client() as client, open_feed(client) as feed:
        answer = await client.post("/v1/generate", json=stream_body(max_new_tokens=6))
        assert answer.status_code == 200
        text = answer.json()["text"]
        request_id = answer.headers["X-Request-ID"]

        def ended() -> bool:
            rows = feed.rows(request_id)
            return bool(rows) and rows[-1]["state"] in ("eos", "length", "stop")

        await feed.until(ended, "the row's end")
        assert text.endswith(feed.rows(request_id)[-1]["text"])


async def test_a_resumable_stream_without_a_reader_is_detached_until_deleted(
    server: RunningServer,
) -> None:
    async with server.client() as client, open_feed(client) as feed:
        created = await client.post("/v1/requests", json=long_body())
        assert created.status_code == 201
        request_id = created.json()["id"]
        await feed.until(lambda: any(r["state"] == "detached" for r in feed.rows(request_id)),
                         "the stream detached: generating with no reader")
        assert (await client.delete(f"/v1/requests/{request_id}")).status_code in (200, 204)

        def released() -> bool:
            rows = feed.rows(request_id)
            return bool(rows) and rows[-1]["state"] == "cancelled" and rows[-1]["released"]

        await feed.until(released, "the row cancelled with its blocks back")
