"""One API key cannot lock the others out (issue 33, item 4), over real HTTP.

Each key gets a fair share of every server-wide cap (``app/key_shares.py``): a key at its
share of ``max_detached_streams`` or ``max_waiting`` is refused with 429 ``key_limit``
while another key's requests are still admitted; ``key_max_streams`` limits the open
streams of every key without its own ``max_streams``, ``STREAMSCOPE_API_KEY``'s too; a
stream rebuilt on another replica by failover counts against the key that made it. The
engine's steps are held wherever a stream must stay waiting or generating, so no test
depends on the machine's speed; the teardown checks every block came back once.

Before: the caps were first come, first served (key B took all of them and key A got
``too_many_detached`` or ``too_many_waiting``), the single key had no limit, and a
rebuilt stream held no slot of its key.
"""

from __future__ import annotations

from typing import Any

import httpx

from app.key_shares import fair_share
from streams.resume import Holding
from tests.http_clients import long_body
from tests.http_server import RunningServer, StartServer
from tests.test_client_limits import assert_refused, bearer
from tests.test_replicas import (  # noqa: F401 (redis_process, redis_url: fixtures)
    holding,
    redis_process,
    redis_url,
    two_replicas,
)

ALICE = {"name": "alice", "key": "alice-0123456789abcdefghijklmnopqrstuvwxyz"}
BOB = {"name": "bob", "key": "bob-0123456789abcdefghijklmnopqrstuvwxyz"}
DEFAULT_KEY = "default-0123456789abcdefghijklmnopqrstuvwxyz"  # STREAMSCOPE_API_KEY


async def create(client: httpx.AsyncClient, key: dict[str, Any] | str) -> httpx.Response:
    return await client.post("/v1/requests", json=long_body(), headers=bearer(key))


async def delete_all(client: httpx.AsyncClient,
                     made: list[tuple[httpx.Response, dict[str, Any] | str]]) -> None:
    for response, key in made:
        if response.status_code == 201:
            deleted = await client.delete(f"/v1/requests/{response.json()['id']}",
                                          headers=bearer(key))
            assert deleted.status_code == 204


# -- the rule --------------------------------------------------------------------------


def test_the_share_keeps_room_for_every_key_and_lets_a_lone_key_use_the_rest() -> None:
    assert fair_share(6, {}, "b", 1) == 6  # one key: the whole cap
    assert fair_share(6, {"b": 4}, "b", 2) == 5  # alone of two: all but one place
    assert fair_share(6, {"b": 4}, "b", 3) == 4  # one place kept for each idle key
    assert fair_share(6, {"b": 5}, "a", 2) == 1  # a key with none may take one
    assert fair_share(6, {"b": 5, "a": 1}, "b", 2) == 3  # both active: half each
    assert fair_share(6, {"b": 5, "a": 1}, "a", 2) == 1  # the rest is held (not cut)
    assert fair_share(2, {"b": 1}, "b", 5) == 1  # more keys than places: one each
    for cap in range(1, 12):
        for keys in range(2, 6):  # a lone key never leaves another key without room
            assert fair_share(cap, {"b": 0}, "b", keys) <= max(1, cap - (keys - 1))


# -- detached (resumable) streams ------------------------------------------------------


async def test_a_key_at_its_share_of_detached_streams_leaves_room_for_another(
    start_server: StartServer,
) -> None:
    server = await start_server(api_keys=[ALICE, BOB], max_detached_streams=4)
    server.recorder.hold()  # the detached streams cannot end meanwhile
    async with server.client() as client:
        bobs = [(await create(client, BOB), BOB) for _ in range(3)]
        bob_over = await create(client, BOB)  # one place kept for alice
        alices = [(await create(client, ALICE), ALICE)]
        await delete_all(client, bobs[:1])
        bob_still_over = await create(client, BOB)  # alice is active: half each
        await delete_all(client, bobs[1:2])
        bob_within = await create(client, BOB)  # holds 1 again: its share is 2
        submitted = len(server.recorder.submitted)
        await delete_all(client, [*bobs[2:], *alices, (bob_within, BOB)])

    assert [r.status_code for r, _ in bobs] == [201, 201, 201]
    assert_refused(bob_over, 429, "key_limit")
    assert "'bob'" in bob_over.json()["error"]["message"]
    assert alices[0][0].status_code == 201, alices[0][0].text  # before: too_many_detached
    assert_refused(bob_still_over, 429, "key_limit")
    assert bob_within.status_code == 201
    assert submitted == 5  # the refused reached no engine


async def test_a_key_s_read_resumable_streams_count_since_each_can_be_left_detached(
    start_server: StartServer,
) -> None:
    """Else a key would fill the cap by opening streams it reads and dropping them."""
    server = await start_server(api_keys=[ALICE, BOB], max_detached_streams=2)
    server.recorder.hold()
    async with server.client() as client:
        async with client.stream("POST", "/v1/stream", json=long_body(resumable=True),
                                 headers=bearer(BOB)) as read:
            assert read.status_code == 200
            request_id = read.headers["x-request-id"]
            bob_over = await create(client, BOB)
            alice = await create(client, ALICE)
        await server.wait_for(lambda: holding(server, request_id) is Holding.DETACHED,
                              "bob's reader gone")
        await delete_all(client, [(alice, ALICE)])
        assert (await client.delete(f"/v1/requests/{request_id}",
                                    headers=bearer(BOB))).status_code == 204

    assert_refused(bob_over, 429, "key_limit")
    assert alice.status_code == 201, alice.text


# -- waiting streams -------------------------------------------------------------------


async def test_a_key_at_its_share_of_waiting_streams_leaves_room_for_another(
    start_server: StartServer,
) -> None:
    server = await start_server(api_keys=[ALICE, BOB], max_waiting=4)
    server.recorder.hold()  # no first token: every stream stays waiting
    async with server.client() as client:
        bobs = [(await create(client, BOB), BOB) for _ in range(3)]
        bob_over = await create(client, BOB)
        bob_openai = await client.post("/v1/completions", json={"prompt": "Hi"},
                                       headers=bearer(BOB))
        alice = await create(client, ALICE)
        full = await create(client, ALICE)  # the cap itself: 4 wait
        waiting = server.hub.statistics().waiting
        await delete_all(client, [*bobs, (alice, ALICE)])

    assert [r.status_code for r, _ in bobs] == [201, 201, 201]
    assert_refused(bob_over, 429, "key_limit")
    assert bob_openai.status_code == 429  # OpenAI's shape, our type as its code
    assert bob_openai.json()["error"]["code"] == "key_limit"
    assert int(bob_openai.headers["retry-after"]) >= 1
    assert alice.status_code == 201, alice.text  # before: too_many_waiting
    assert_refused(full, 429, "too_many_waiting")
    assert waiting == 4


# -- the open-stream limit, STREAMSCOPE_API_KEY's too ----------------------------------


async def test_key_max_streams_limits_the_single_key_and_keys_without_their_own(
    start_server: StartServer,
) -> None:
    server = await start_server(api_key=DEFAULT_KEY, key_max_streams=2,
                                api_keys=[BOB, {**ALICE, "max_streams": 3}])
    server.recorder.hold()
    async with server.client() as client:
        made = [(await create(client, DEFAULT_KEY), DEFAULT_KEY) for _ in range(2)]
        default_over = await create(client, DEFAULT_KEY)
        made += [(await create(client, BOB), BOB) for _ in range(2)]
        bob_over = await create(client, BOB)
        made += [(await create(client, ALICE), ALICE) for _ in range(3)]
        await delete_all(client, made)

    assert [r.status_code for r, _ in made] == [201] * 7  # alice: her own limit, 3
    assert_refused(default_over, 429, "too_many_streams")
    assert_refused(bob_over, 429, "too_many_streams")


# -- a stream rebuilt by failover ------------------------------------------------------


async def test_a_stream_rebuilt_by_failover_counts_against_its_key(
    start_server: StartServer, redis_url: str,  # noqa: F811
) -> None:
    """Alice (one stream at most) made a stream on A, which left it to B (its drain's
    hand-over, as before a death); resumed on B, it is rebuilt there and holds her
    slot: her next request on B is refused while Bob's is admitted."""
    a, b = await two_replicas(start_server, redis_url,
                              api_keys=[{**ALICE, "max_streams": 1}, BOB])
    a.recorder.hold()
    async with a.client() as client:
        created = await create(client, ALICE)
    assert created.status_code == 201, created.text
    request_id = created.json()["id"]
    registry = a.app.runtime.resumption
    assert registry is not None and await registry.hand_over() == 1
    a.recorder.release()

    b.recorder.hold()  # the rebuilt stream generates on, unread to its end
    async with b.client() as client:
        async with client.stream("GET", f"/v1/stream/{request_id}",
                                 headers=bearer(ALICE)) as resumed:
            assert resumed.status_code == 200
            assert b.app.runtime.statistics()["resume_failovers"] == 1
            alice_over = await create(client, ALICE)
            bob = await create(client, BOB)
            await delete_all(client, [(bob, BOB)])
        assert (await client.delete(f"/v1/requests/{request_id}",
                                    headers=bearer(ALICE))).status_code == 204
        b.recorder.release()
        await b.wait_for(lambda: b.app.runtime.shares is not None
                         and not b.app.runtime.shares.usage.open, "the slots given back")

    assert_refused(alice_over, 429, "too_many_streams")  # before: 201
    assert bob.status_code == 201, bob.text


async def test_a_server_without_keys_counts_nothing(server: RunningServer) -> None:
    assert server.app.runtime.shares is None
