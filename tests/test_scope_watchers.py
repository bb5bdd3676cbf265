"""``/scope/events`` watchers are capped, per key and in all (issue 43, item 5), and a
``Last-Event-ID`` of thousands of digits is ignored (item 6), over real HTTP.

A GET of the feed takes no stream slot, yet every watcher costs each step a write of
each frame (and, before, its own JSON encode of it: ``app.wire.SharedFrames`` now
shares the bytes of a view): with 400 watchers open another key's 100 tokens took
1.4-3.4 s instead of 0.2-0.4 s. So a key holds at most ``scope_key_watchers``
(``scope_operator_watchers`` for an operator key), the server ``scope_max_watchers``;
past a cap: 429 ``too_many_watchers`` with the JSON envelope and ``Retry-After``, before
the stream. A watcher closed gives its place back.

Before: every GET was answered 200, however many were open; and ``<epoch>-<5,000
digits>`` as ``Last-Event-ID`` was a 500 (``int()`` past Python's int max str digits).
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import httpx

from tests.http_server import RunningServer, StartServer
from tests.test_client_limits import assert_refused, bearer
from tests.test_scope_http import ALICE_KEY, BOB_KEY, KEYS, OPS_KEY, open_feed


async def watch(stack: AsyncExitStack, client: httpx.AsyncClient,
                key: str | None = None) -> None:
    """Open one more watcher, held open until ``stack`` closes."""
    await stack.enter_async_context(
        open_feed(client, **({} if key is None else bearer(key))))


async def refused(client: httpx.AsyncClient, key: str | None = None) -> httpx.Response:
    return await client.get("/scope/events", headers={} if key is None else bearer(key))


async def watchers(server: RunningServer, n: int) -> None:
    await server.wait_for(lambda: server.hub.scope.watchers == n, f"{n} watchers")


async def test_a_key_holds_at_most_its_watchers_and_an_operator_key_more(
    start_server: StartServer,
) -> None:
    server = await start_server(api_keys=KEYS, scope_operator_keys=frozenset({"ops"}),
                                scope_key_watchers=2, scope_operator_watchers=3)
    async with server.client() as client, AsyncExitStack() as stack:
        for _ in range(2):
            await watch(stack, client, ALICE_KEY)
        alice_over = await refused(client, ALICE_KEY)
        for _ in range(2):
            await watch(stack, client, BOB_KEY)  # another key's are its own
        for _ in range(3):
            await watch(stack, client, OPS_KEY)
        ops_over = await refused(client, OPS_KEY)
        async with AsyncExitStack() as one:  # alice's third, once one of hers closed
            await stack.aclose()
            await watchers(server, 0)
            await watch(one, client, ALICE_KEY)
            await watch(one, client, ALICE_KEY)

    assert_refused(alice_over, 429, "too_many_watchers")
    assert "'alice'" in alice_over.json()["error"]["message"]
    assert "STREAMSCOPE_SCOPE_KEY_WATCHERS" in alice_over.json()["error"]["message"]
    assert_refused(ops_over, 429, "too_many_watchers")
    assert "STREAMSCOPE_SCOPE_OPERATOR_WATCHERS" in ops_over.json()["error"]["message"]


async def test_the_server_holds_at_most_its_watchers_in_all(
    start_server: StartServer,
) -> None:
    server = await start_server(scope_max_watchers=3)  # no keys: one cap, everyone's
    async with server.client() as client:
        async with AsyncExitStack() as stack:
            for _ in range(3):
                await watch(stack, client)
            over = await refused(client)
            stats = (await client.get("/stats")).status_code
        await watchers(server, 0)
        async with AsyncExitStack() as stack:
            await watch(stack, client)  # the places came back

    assert_refused(over, 429, "too_many_watchers")
    assert "STREAMSCOPE_SCOPE_MAX_WATCHERS" in over.json()["error"]["message"]
    assert stats == 200


async def test_a_last_event_id_of_thousands_of_digits_is_ignored_for_a_snapshot(
    server: RunningServer,
) -> None:
    async with server.client() as client:
        async with open_feed(client) as feed:  # a frame id of this server's life
            await feed.until(lambda: bool(feed.events), "its snapshot")
            epoch = feed.events[0].id.partition("-")[0]
        for last in (f"{epoch}-{'9' * 5000}", "9" * 5000):
            async with open_feed(client, **{"Last-Event-ID": last}) as again:
                await again.until(lambda: bool(again.events), "a snapshot")
                assert again.events[0].event == "snapshot", last[:20]
        for query in (f"{epoch}-{'9' * 5000}", f"{epoch}-%D9%A3"):  # ٣: a digit, not ASCII
            async with open_feed(client, f"/scope/events?last_event_id={query}") as by_query:
                await by_query.until(lambda: bool(by_query.events), "a snapshot")
                assert by_query.events[0].event == "snapshot"
