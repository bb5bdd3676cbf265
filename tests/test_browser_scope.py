"""The scope page (issue 38) in a real headless Chromium, over real HTTP.

As ``test_browser_page.py``: Debian's Chromium and chromedriver (the tests FAIL with the
install command where either is missing, never skip), the server in this test's Trio
loop, selenium's blocking calls in a worker thread. The streams come from another client
(raw sockets), as they would from other people: the page only watches.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from app.wire.scope_events import SHORT_ID
from tests.browser import CHROMEDRIVER, CHROMIUM, headless_chromium
from tests.http_clients import RawClient, long_body
from tests.http_server import SETTLE_TIMEOUT_S, RunningServer, StartServer

INSTALL = "apt-get update && apt-get install -y chromium chromium-driver"
STREAMS = 8
LONG_READ_S = 120.0  # the staying streams read to their end: a net against a hang only
PAGE_TIMEOUT_S = SETTLE_TIMEOUT_S  # a safety net: each wait is for a condition


@dataclass
class Page:
    """The scope page in a headless Chromium; every method blocks (use ``call``)."""

    driver: Any

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args)

    def open(self, url: str) -> None:
        self.driver.get(url)
        self.wait_for(lambda: self.js("return window.scope && window.scope.snapshots") >= 1,
                      "the first snapshot")

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def row(self, request_id: str) -> dict[str, str] | None:
        """The row's state and whether its blocks are back, as the table shows them."""
        return self.js(
            "const tr = document.getElementById('row-' + arguments[0]);"
            "return tr ? {state: tr.dataset.state, released: tr.dataset.released,"
            " blocks: tr.querySelector('td.blocks').textContent} : null;", request_id[:SHORT_ID])

    def moments(self, request_id: str) -> list[str]:
        return list(self.js("return window.scope.moments.filter(m => m.id === arguments[0])"
                            ".map(m => m.kind)", request_id[:SHORT_ID]))

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        from selenium.webdriver.support.wait import WebDriverWait

        try:
            WebDriverWait(self.driver, PAGE_TIMEOUT_S, poll_frequency=0.02).until(
                lambda _: condition())
        except Exception as exc:  # TimeoutException, or the page went away
            status = self.js("return document.getElementById('status').textContent")
            raise AssertionError(f"timed out waiting for {what}; status {status!r}") from exc


@pytest.fixture(scope="module")
def page() -> Iterator[Page]:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: the browser tests need Debian's "
                    f"Chromium; install it with: {INSTALL}", pytrace=False)
    with headless_chromium("--window-size=1400,900") as driver:
        yield Page(driver)


async def open_streams(server: RunningServer, count: int) -> list[RawClient]:
    clients = []
    for _ in range(count):
        client = server.raw_client()
        await client.post("/v1/stream", long_body())
        clients.append(client)
    for client in clients:
        await client.read_tokens(2)
    return clients


async def test_eight_streams_and_one_that_leaves_ends_cancelled_with_its_blocks_back(
    start_server: StartServer, page: Page,
) -> None:
    server = await start_server(max_batch=STREAMS)
    await page.call(page.open, server.base_url + "/scope")
    clients = await open_streams(server, STREAMS)
    ids = [c.request_id() for c in clients]
    await page.call(page.wait_for, lambda: all(page.row(i) for i in ids), "eight rows")
    leaving, staying = clients[0], clients[1:]
    leaving.close_abort()  # RST: this client is gone
    await page.call(page.wait_for, lambda: page.row(ids[0]) == {
        "state": "cancelled", "released": "true", "blocks": "back"},
        "the row cancelled with its blocks back")
    assert page.moments(ids[0]) == ["disconnect"]
    assert all(page.row(i)["state"] in ("running", "paused") for i in ids[1:])  # type: ignore[index]
    async with trio.open_nursery() as nursery:  # 7 x ~478 tokens: seconds, more when busy
        for client in staying:
            nursery.start_soon(client.read_to_end, LONG_READ_S)
    await page.call(page.wait_for, lambda: all(page.row(i)["state"] == "length"  # type: ignore[index]
                                               for i in ids[1:]), "the others' ends")
    pool = page.js("return window.scope.pool")
    assert pool["free"] == pool["total"]


async def test_a_slow_reader_shows_paused_then_dropped(
    start_server: StartServer, page: Page,
) -> None:
    server = await start_server(queue_limit=8, stall_timeout_s=0.5)
    await page.call(page.open, server.base_url + "/scope")
    slow = server.raw_client()  # a small receive buffer, and it reads nothing
    slow.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await slow.post("/v1/stream", long_body())
    await server.wait_for(lambda: bool(server.recorder.submitted), "the stream")
    request_id = server.recorder.submitted[0]
    await page.call(page.wait_for, lambda: (page.row(request_id) or {}).get("state")
                    == "dropped", "the row dropped")
    assert page.moments(request_id) == ["pause", "drop"]
    await page.call(page.wait_for, lambda: page.row(request_id)["released"] == "true",  # type: ignore[index]
                    "its blocks back")
    slow.close_abort()
