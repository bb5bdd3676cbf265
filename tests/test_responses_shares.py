"""Background responses take their key's fair share of ``max_detached_streams``
(issue 43, item 4), over real HTTP with three API keys.

A background response is a resumable stream (``responses_background.py``): it may
generate with no reader, so it counts against the server's cap of detached streams,
and (``app/key_shares.py``) against its key's share of it, as ``POST /v1/requests``
and ``POST /v1/stream`` with ``resumable`` do. The engine's steps are held, so every
stream stays generating whatever the machine's speed; the teardown checks every block
came back once.

Before: the background route opened its stream without ``resumable=True``, so the
shares never saw it: with a cap of 6, carol's six background responses took every
place and alice and bob were refused 429 ``too_many_detached`` on all three routes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from engine.model import LoadedModel
from tests.http_clients import long_body
from tests.http_server import RunningServer, StartServer
from tests.test_client_limits import bearer
from tests.test_responses_sdk import MODEL, serve

ALICE = {"name": "alice", "key": "alice-0123456789abcdefghijklmnopqrstuvwxyz"}
BOB = {"name": "bob", "key": "bob-0123456789abcdefghijklmnopqrstuvwxyz"}
CAROL = {"name": "carol", "key": "carol-0123456789abcdefghijklmnopqrstuvwxyz"}
CAP = 6


async def background(client: httpx.AsyncClient, key: dict[str, Any]) -> httpx.Response:
    return await client.post("/v1/responses", headers=bearer(key), json={
        "model": MODEL, "input": "Once upon a time", "max_output_tokens": 400,
        "background": True})


async def cancel(client: httpx.AsyncClient, made: httpx.Response,
                 key: dict[str, Any]) -> None:
    if made.status_code == 200:
        cancelled = await client.post(f"/v1/responses/{made.json()['id']}/cancel",
                                      headers=bearer(key))
        assert cancelled.status_code == 200, cancelled.text


async def test_background_responses_take_only_their_keys_share_of_detached_streams(
    start_server: StartServer, tiny_model: Callable[[str], LoadedModel],
) -> None:
    server: RunningServer = await serve(start_server, tiny_model,
                                        api_keys=[ALICE, BOB, CAROL],
                                        max_detached_streams=CAP)
    server.recorder.hold()  # every stream stays generating: none ends meanwhile
    async with server.client() as client:
        carols = [await background(client, CAROL) for _ in range(CAP)]
        alice_background = await background(client, ALICE)
        bob_request = await client.post("/v1/requests", json=long_body(),
                                        headers=bearer(BOB))
        made = [*((r, CAROL) for r in carols), (alice_background, ALICE)]
        if alice_background.status_code == 200:  # alice's place, for her next stream
            await cancel(client, made.pop()[0], ALICE)
        async with client.stream("POST", "/v1/stream", json=long_body(resumable=True),
                                 headers=bearer(ALICE)) as alice_stream:
            alice_status = alice_stream.status_code
        for response, key in made:
            await cancel(client, response, key)
        if bob_request.status_code == 201:
            deleted = await client.delete(f"/v1/requests/{bob_request.json()['id']}",
                                          headers=bearer(BOB))
            assert deleted.status_code == 204
        server.recorder.release()

    # carol alone of three keys: the cap less one place kept for each of the others
    assert [r.status_code for r in carols] == [200] * (CAP - 2) + [429] * 2, \
        [r.text for r in carols]
    refused = carols[-1].json()["error"]
    assert refused["code"] == "key_limit" and "'carol'" in refused["message"]
    assert int(carols[-1].headers["retry-after"]) >= 1
    # before: each of these three was refused 429 too_many_detached
    assert alice_background.status_code == 200, alice_background.text
    assert bob_request.status_code == 201, bob_request.text
    assert alice_status == 200
