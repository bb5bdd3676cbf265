"""One client cannot hold the whole server (issue 23, item 3), over real HTTP.

A stream made by ``POST /v1/requests`` that no reader comes to within
``attach_timeout_s`` is cancelled; at ``max_detached_streams`` streams generating with
no reader, a new resumable stream is refused (429 ``too_many_detached``); a key of
``STREAMSCOPE_API_KEYS`` holds at most its ``max_streams`` (429 ``too_many_streams``),
and its resumable streams are its own: another key's read, take-over or DELETE is 404.
The engine's steps are held wherever a stream must outlast a timer or a count, so no
test depends on the machine's speed; the teardown checks every block came back once.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio

from app.settings import Settings, SettingsError
from engine import FinishReason
from streams.resume import Holding
from tests.http_clients import long_body, parse_sse, stream_body
from tests.http_server import POLL_S, SETTLE_TIMEOUT_S, RunningServer, StartServer

ALICE = {"name": "alice", "key": "alice-0123456789abcdefghijklmnopqrstuvwxyz", "max_streams": 2}
BOB = {"name": "bob", "key": "bob-0123456789abcdefghijklmnopqrstuvwxyz"}  # no limit
DEFAULT_KEY = "default-0123456789abcdefghijklmnopqrstuvwxyz"  # STREAMSCOPE_API_KEY
SHORT = stream_body(max_new_tokens=4, ignore_eos=True)


def bearer(entry: dict[str, Any] | str) -> dict[str, str]:
    key = entry if isinstance(entry, str) else entry["key"]
    return {"Authorization": f"Bearer {key}"}


def assert_refused(response: httpx.Response, status: int, error_type: str) -> None:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["type"] == error_type
    if status == 429:
        assert int(response.headers["retry-after"]) >= 1


def registry_of(server: RunningServer) -> Any:
    registry = server.app.runtime.resumption
    assert registry is not None
    return registry


# -- a stream nobody comes to read ----------------------------------------------------------


async def test_a_created_stream_that_no_reader_attaches_to_is_cancelled(
    start_server: StartServer,
) -> None:
    """Without the attach timeout it would generate for nobody for the whole grace
    period (60 s here): the engine is held, so only the timeout can end it."""
    server = await start_server(attach_timeout_s=0.3, resume_grace_s=60.0)
    server.recorder.hold()
    async with server.client() as client:
        created = await client.post("/v1/requests", json=long_body())
    assert created.status_code == 201
    request_id = created.json()["id"]

    await server.wait_for(lambda: server.app.runtime.statistics()["resume_expiries"] == 1,
                          "the attach timeout")
    server.recorder.release()
    finish = await server.wait_finished(request_id)
    async with server.client() as client:
        gone = await client.get(f"/v1/stream/{request_id}")

    assert finish.reason is FinishReason.CANCELLED
    assert gone.status_code == 204
    assert server.app.runtime.statistics()["resumable_streams"] == 0


async def test_a_reader_that_came_in_time_leaves_the_stream_its_grace_period(
    start_server: StartServer,
) -> None:
    """The attach timeout is for the first reader only: once one read, a reader that
    leaves gets the whole grace period to come back."""
    server = await start_server(attach_timeout_s=0.3, resume_grace_s=60.0)
    async with server.client() as client:
        request_id = (await client.post("/v1/requests", json=long_body())).json()["id"]
        async with client.stream("GET", f"/v1/stream/{request_id}") as response:
            assert response.status_code == 200
            async for _ in response.aiter_bytes():
                break  # the start event at least: then the connection closes
        registry = registry_of(server)
        await server.wait_for(lambda: registry.holding(request_id) is Holding.DETACHED,
                              "the reader gone")
        entry = registry._local.get(request_id)  # tests may use internals: the deadline
        assert entry is not None and entry.holder is not None
        left_s = entry.holder.scope.deadline - trio.current_time()
        deleted = await client.delete(f"/v1/requests/{request_id}")

    assert left_s > 30.0  # the grace period, not the attach timeout
    assert deleted.status_code == 204


# -- the cap on streams generating with no reader ------------------------------------------


async def test_past_max_detached_streams_a_new_resumable_stream_is_refused_with_429(
    start_server: StartServer,
) -> None:
    server = await start_server(max_detached_streams=2)
    server.recorder.hold()  # the detached streams cannot end meanwhile
    async with server.client() as client:
        first = await client.post("/v1/requests", json=long_body())
        second = await client.post("/v1/requests", json=long_body())
        refused = await client.post("/v1/requests", json=long_body())
        refused_stream = await client.post("/v1/stream", json=long_body(resumable=True))
        submitted = len(server.recorder.submitted)
        deleted = await client.delete(f"/v1/requests/{first.json()['id']}")
        again = await client.post("/v1/requests", json=long_body())
        for created in (second, again):
            await client.delete(f"/v1/requests/{created.json()['id']}")

    assert (first.status_code, second.status_code) == (201, 201)
    assert_refused(refused, 429, "too_many_detached")
    assert_refused(refused_stream, 429, "too_many_detached")
    assert submitted == 2  # the refused reached no engine
    assert (deleted.status_code, again.status_code) == (204, 201)


# -- per-key limits ---------------------------------------------------------------------


async def test_each_key_holds_at_most_its_max_streams(start_server: StartServer) -> None:
    server = await start_server(api_keys=[ALICE, BOB])
    server.recorder.hold()  # nothing ends by itself meanwhile
    async with server.client() as client:
        mine = [await client.post("/v1/requests", json=long_body(), headers=bearer(ALICE))
                for _ in range(2)]
        over = await client.post("/v1/requests", json=long_body(), headers=bearer(ALICE))
        over_plain = await client.post("/v1/stream", json=SHORT, headers=bearer(ALICE))
        bobs = [await client.post("/v1/requests", json=long_body(), headers=bearer(BOB))
                for _ in range(3)]
        submitted = len(server.recorder.submitted)
        await client.delete(f"/v1/requests/{mine[0].json()['id']}", headers=bearer(ALICE))
        after = await client.post("/v1/requests", json=long_body(), headers=bearer(ALICE))
        for created, key in [(mine[1], ALICE), (after, ALICE), *((b, BOB) for b in bobs)]:
            await client.delete(f"/v1/requests/{created.json()['id']}", headers=bearer(key))
        metrics = (await client.get("/metrics")).text

    assert [r.status_code for r in (*mine, *bobs, after)] == [201] * 6
    assert_refused(over, 429, "too_many_streams")
    assert_refused(over_plain, 429, "too_many_streams")
    assert submitted == 5  # refused before the body was read: nothing reached the engine
    assert 'streamscope_refusals_total{status="429",type="too_many_streams"} 2.0' in metrics


async def test_a_key_s_plain_stream_counts_while_it_is_open(start_server: StartServer) -> None:
    server = await start_server(api_keys=[{**ALICE, "max_streams": 1}])
    server.recorder.hold()
    async with server.client() as client:
        async with client.stream("POST", "/v1/stream", json=long_body(),
                                 headers=bearer(ALICE)) as open_stream:
            assert open_stream.status_code == 200
            refused = await client.post("/v1/generate", json=SHORT, headers=bearer(ALICE))
        server.recorder.release()  # the stream's client left: its slot comes back
        answered = await post_until_not_refused(client, "/v1/generate", SHORT, bearer(ALICE))

    assert_refused(refused, 429, "too_many_streams")
    assert answered.status_code == 200


async def test_a_finished_stream_gives_its_key_s_slot_back_though_its_log_is_kept(
    start_server: StartServer,
) -> None:
    server = await start_server(api_keys=[{**ALICE, "max_streams": 1}], resume_grace_s=60.0)
    async with server.client() as client:
        created = await client.post("/v1/requests", json=SHORT, headers=bearer(ALICE))
        read = await client.get(created.json()["stream_url"])
        next_one = await client.post("/v1/requests", json=SHORT, headers=bearer(ALICE))
        read_next = await client.get(next_one.json()["stream_url"])

    assert parse_sse(read.content)[-1].event == "done"
    assert server.app.runtime.statistics()["resumable_streams"] == 2  # logs kept
    assert next_one.status_code == 201, next_one.text
    assert parse_sse(read_next.content)[-1].event == "done"


async def post_until_not_refused(client: httpx.AsyncClient, path: str, body: dict[str, Any],
                                 headers: dict[str, str]) -> httpx.Response:
    """POST until it is not a 429 (a slot comes back when its connection has ended)."""
    with trio.fail_after(SETTLE_TIMEOUT_S):
        # The slot comes back when the connection's task ends: no event to wait on.
        while (response := await client.post(path, json=body, headers=headers)).status_code \
                == 429:  # noqa: ASYNC110
            await trio.sleep(POLL_S)
    return response


# -- a key's streams are its own ----------------------------------------------------------


async def test_another_key_cannot_read_take_over_or_delete_a_key_s_stream(
    start_server: StartServer,
) -> None:
    server = await start_server(api_key=DEFAULT_KEY, api_keys=[ALICE, BOB])
    async with server.client() as client:
        created = await client.post("/v1/requests", json=SHORT, headers=bearer(ALICE))
        request_id = created.json()["id"]
        path = f"/v1/stream/{request_id}"
        strangers = []
        for key in (BOB, DEFAULT_KEY):
            strangers += [
                await client.get(path, headers=bearer(key)),
                await client.get(path, headers={**bearer(key), "Last-Event-ID": f"{request_id}:1"}),
                await client.get(f"{path}?last_event_id={request_id}:2", headers=bearer(key)),
                await client.delete(f"/v1/requests/{request_id}", headers=bearer(key)),
            ]
        unknown_to_bob = await client.get("/v1/stream/0123456789abcdef0123456789abcdef",
                                          headers=bearer(BOB))
        own = await client.get(path, headers=bearer(ALICE))

    for response in strangers:
        assert_refused(response, 404, "not_found")
    assert_refused(unknown_to_bob, 404, "not_found")  # the same answer: nothing told apart
    assert own.status_code == 200
    events = parse_sse(own.content)
    assert [e.event for e in events] == ["start"] + ["token"] * 4 + ["done"]
    finish = await server.wait_finished(request_id)
    assert finish.reason is FinishReason.LENGTH  # no stranger cancelled it


async def test_the_binding_needs_no_state_so_every_replica_refuses_another_key(
    start_server: StartServer,
) -> None:
    """The id says which key made it: a replica that never saw the stream refuses
    another key's read of it with the same 404, and answers its own key as usual."""
    a = await start_server(api_keys=[ALICE, BOB])
    b = await start_server(api_keys=[ALICE, BOB])
    async with a.client() as on_a, b.client() as on_b:
        request_id = (await on_a.post("/v1/requests", json=SHORT,
                                      headers=bearer(ALICE))).json()["id"]
        stranger = await on_b.get(f"/v1/stream/{request_id}", headers=bearer(BOB))
        owner = await on_b.get(f"/v1/stream/{request_id}", headers=bearer(ALICE))
        read = await on_a.get(f"/v1/stream/{request_id}", headers=bearer(ALICE))

    assert_refused(stranger, 404, "not_found")
    assert owner.status_code == 204  # unknown there (no shared store): nothing to read
    assert parse_sse(read.content)[-1].event == "done"


# -- the setting -------------------------------------------------------------------------


def test_api_keys_are_read_from_json_and_never_echoed() -> None:
    settings = Settings.from_env({"STREAMSCOPE_API_KEYS": json.dumps([ALICE, BOB])})

    assert [(k.name, k.max_streams) for k in settings.api_keys] == [("alice", 2), ("bob", None)]
    assert ALICE["key"] not in repr(settings)


@pytest.mark.parametrize(("entries", "problem"), [
    ("[{", "expected a JSON list"),
    ('{"alice": "x"}', "expected a JSON list"),
    ([{**ALICE, "extra": 1}], "entry 1: expected an object"),
    ([ALICE, {**BOB, "name": "alice"}], "the same name"),
    ([ALICE, {**BOB, "key": ALICE["key"]}], "the same key"),
    ([{**ALICE, "max_streams": 0}], "entry 1 (alice): max_streams"),
    ([BOB, {**ALICE, "key": "short"}], "entry 2 (alice): the key: too short"),
    ([{**ALICE, "name": "has space"}], "entry 1: the name"),
])
def test_bad_api_keys_stop_the_server_at_startup_naming_the_entry(
    entries: object, problem: str,
) -> None:
    text = entries if isinstance(entries, str) else json.dumps(entries)
    with pytest.raises(SettingsError, match="STREAMSCOPE_API_KEYS") as caught:
        Settings.from_env({"STREAMSCOPE_API_KEYS": text})

    assert problem in str(caught.value)
    assert ALICE["key"] not in str(caught.value)


def test_the_single_api_key_may_not_also_be_one_of_the_api_keys() -> None:
    with pytest.raises(SettingsError, match="also in STREAMSCOPE_API_KEYS"):
        Settings(api_key=ALICE["key"], api_keys=[ALICE])
