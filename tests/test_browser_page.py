"""The browser page (issue 9, section 3) in a real headless Chromium, over real HTTP.

Chromium and its driver are Debian's (``/usr/bin/chromium``, ``/usr/bin/chromedriver``),
driven by selenium with both paths given, so Selenium Manager never downloads anything.
Where either is missing the tests FAIL with the install command (CI installs them in
``.ci/run``); they never skip.

The server runs in this test's Trio loop (``start_server``); selenium's calls block, so
each runs in a worker thread (``Browser.call``) while the loop serves the page. A drop
is made by ``CuttingProxy``, a loopback TCP proxy between the browser and the server
that resets the first event-stream response after a given number of its body bytes,
both ways (RST), then forwards every later connection untouched.
"""

from __future__ import annotations

import os
import re
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import trio

from engine import FinishReason
from tests.browser import CHROMEDRIVER, CHROMIUM, headless_chromium
from tests.http_server import SETTLE_TIMEOUT_S, RunningServer, StartServer

INSTALL = "apt-get update && apt-get install -y chromium chromium-driver"
PROMPT = "The capital of France is"
TOKENS = 24  # greedy, ignore_eos: 26 events, about 2.5 kB on the wire
CUT_AFTER_BYTES = 600  # into the fifth or sixth token event: cut mid-event
PAGE_TIMEOUT_S = SETTLE_TIMEOUT_S  # a safety net: each wait is for a condition


# -- the browser -------------------------------------------------------------------------


@dataclass
class Browser:
    """A headless Chromium with the page's controls; every method blocks (use ``call``)."""

    driver: Any

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args)

    def open(self, url: str) -> None:
        self.driver.get(url)
        self.wait_for(lambda: self.js("return document.readyState") == "complete", "the page")

    def js(self, script: str, *args: Any) -> Any:
        return self.driver.execute_script(script, *args)

    def fill(self, **fields: object) -> None:
        """Set inputs by id: strings and numbers as values, booleans as checkboxes."""
        for element_id, value in fields.items():
            self.js("const e = document.getElementById(arguments[0]);"
                    "if (typeof arguments[1] === 'boolean') e.checked = arguments[1];"
                    "else e.value = String(arguments[1]);", element_id.replace("_", "-"), value)

    def click(self, element_id: str) -> None:
        self.driver.find_element("id", element_id).click()

    def text_of(self, element_id: str) -> str:
        """The element's ``textContent``, exactly (selenium's ``.text`` folds spaces)."""
        return str(self.js("return document.getElementById(arguments[0]).textContent",
                           element_id))

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        from selenium.webdriver.support.wait import WebDriverWait

        try:
            WebDriverWait(self.driver, PAGE_TIMEOUT_S, poll_frequency=0.02).until(
                lambda _: condition())
        except Exception as exc:  # TimeoutException, or the page went away
            raise AssertionError(
                f"timed out waiting for {what}; status {self.text_of('status')!r}, "
                f"log {self.text_of('log')!r}") from exc

    def wait_status(self, prefix: str) -> str:
        self.wait_for(lambda: self.text_of("status").startswith(prefix), f"status {prefix!r}")
        return self.text_of("status")


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """One headless Chromium for this module's tests (each loads the page afresh)."""
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: the browser tests need Debian's "
                    f"Chromium; install it with: {INSTALL}", pytrace=False)
    with headless_chromium() as driver:
        yield Browser(driver)


# -- a proxy that drops the stream once --------------------------------------------------


class CuttingProxy:
    """Loopback TCP proxy to ``target_port``. The first response whose headers say
    ``text/event-stream`` gets ``cut_after`` bytes of its body through (chunk framing
    included), then both of that connection's sockets are reset: with ``hold_server``,
    the server's only once the server has answered a reconnect (till then the server
    holds the old connection, as for a client that died silently). Nothing else is
    touched, before or after (a connection may carry several requests: keep-alive)."""

    def __init__(self, target_port: int, cut_after: int, *, hold_server: bool = False) -> None:
        self.target_port = target_port
        self.cut_after = cut_after
        self.hold_server = hold_server
        self.cuts = 0
        self.cut = trio.Event()  # the browser's connection was reset
        self.answered = trio.Event()  # a response after the cut went through
        self.statuses: list[bytes] = []  # the status lines of the responses after the cut
        self.port = 0

    async def serve(self, *, task_status: trio.TaskStatus[None]) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started()
        await trio.serve_listeners(self._connection, listeners)

    async def _connection(self, client: trio.SocketStream) -> None:
        upstream = await trio.open_tcp_stream("127.0.0.1", self.target_port)
        async with client, upstream, trio.open_nursery() as nursery:
            nursery.start_soon(self._forward, client, upstream)
            await self._forward_responses(upstream, client)
            nursery.cancel_scope.cancel()

    async def _forward(self, source: trio.SocketStream, sink: trio.SocketStream) -> None:
        try:
            async for data in source:
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _forward_responses(self, upstream: trio.SocketStream,
                                 client: trio.SocketStream) -> None:
        seen = b""  # this connection's responses so far, while no cut is done
        try:
            async for data in upstream:
                if self.cuts:
                    if data.startswith(b"HTTP/1.1 "):
                        self.statuses.append(data.split(b"\r\n", 1)[0])
                        self.answered.set()
                    await client.send_all(data)
                    continue
                start = len(seen)
                seen += data
                body_at = _event_stream_body_at(seen)
                if body_at is None or len(seen) - body_at < self.cut_after:
                    await client.send_all(data)
                    continue
                await client.send_all(data[: body_at + self.cut_after - start])
                self.cuts += 1
                self.cut.set()
                _reset(client)
                if self.hold_server:
                    await client.aclose()
                    with trio.fail_after(SETTLE_TIMEOUT_S):
                        await self.answered.wait()
                _reset(upstream)
                return
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


def _event_stream_body_at(seen: bytes) -> int | None:
    """Where the body of the event-stream response in ``seen`` starts, if its headers
    have all arrived."""
    marker = seen.lower().find(b"content-type: text/event-stream")
    if marker < 0:
        return None
    end = seen.find(b"\r\n\r\n", marker)
    return None if end < 0 else end + 4


def _reset(stream: trio.SocketStream) -> None:
    """SO_LINGER (on, 0): the close that follows sends an RST."""
    stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


# -- helpers -----------------------------------------------------------------------------


def greedy(max_tokens: int = TOKENS) -> dict[str, Any]:
    """The page's fields for a greedy request, and the same request as a JSON body."""
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "top_p": 1,
            "seed": "", "ignore_eos": True}


async def generate_text(server: RunningServer, max_tokens: int = TOKENS) -> str:
    async with server.client() as client:
        response = await client.post("/v1/generate", json={
            "prompt": PROMPT, "max_new_tokens": max_tokens, "temperature": 0.0,
            "top_p": 1.0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    return str(response.json()["text"])


async def stats(server: RunningServer, **headers: str) -> dict[str, Any]:
    async with server.client(headers=headers) as client:
        response = await client.get("/stats")
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


# -- the tests ---------------------------------------------------------------------------


async def test_the_page_shows_what_generate_answers(
    server: RunningServer, browser: Browser
) -> None:
    expected = await generate_text(server)

    await browser.call(browser.open, server.base_url + "/")
    await browser.call(lambda: browser.fill(**greedy()))
    await browser.call(browser.click, "start")
    status = await browser.call(browser.wait_status, "done")

    assert status == f"done: length, {TOKENS} tokens"
    assert await browser.call(browser.text_of, "output") == expected
    assert await browser.call(browser.text_of, "tokens") == str(TOKENS)
    assert (await browser.call(browser.text_of, "ttft")).endswith(" ms")
    assert await browser.call(browser.text_of, "log") == ""  # no reconnect
    # Closed on its final event: else EventSource would reconnect forever.
    assert await browser.call(browser.js, "return lastRun.source.readyState") == 2  # CLOSED


async def test_a_dropped_connection_resumes_with_the_same_text(
    server: RunningServer, browser: Browser
) -> None:
    expected = await generate_text(server)
    proxy = CuttingProxy(server.port, CUT_AFTER_BYTES)
    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        await browser.call(browser.open, f"http://127.0.0.1:{proxy.port}/")
        await browser.call(lambda: browser.fill(**greedy()))
        await browser.call(browser.click, "start")
        status = await browser.call(browser.wait_status, "done")
        nursery.cancel_scope.cancel()

    assert proxy.cuts == 1
    assert status == f"done: length, {TOKENS} tokens, resumed 1×"
    assert await browser.call(browser.text_of, "output") == expected
    log = await browser.call(browser.text_of, "log")
    assert "connection lost after event " in log
    assert "reconnected, resumed at event " in log
    # The page resumed where it was cut: at the event after the last one it received.
    lost_after = int(log.split("connection lost after event ")[1].split(";")[0])
    resumed_at = int(log.split("resumed at event ")[1].split()[0])
    assert 1 < resumed_at == lost_after + 1 < TOKENS + 2
    assert (await stats(server))["resumes"] >= 1


async def test_a_reconnect_takes_the_stream_over_while_the_server_holds_the_old_one(
    server: RunningServer, browser: Browser
) -> None:
    """The server still holds the old connection (it has not noticed it died): the
    browser's reconnect takes the stream over at once, with no refusal."""
    tokens = 200  # still decoding when the engine is held, right after the cut
    expected = await generate_text(server, tokens)
    proxy = CuttingProxy(server.port, CUT_AFTER_BYTES, hold_server=True)

    async def hold_the_engine_until_answered() -> None:
        # The stream must still be live when the browser reconnects, or the server has
        # let it go (the response ended) and there is nothing to take over.
        await proxy.cut.wait()
        server.recorder.hold()
        await proxy.answered.wait()
        server.recorder.release()

    async with trio.open_nursery() as nursery:
        await nursery.start(proxy.serve)
        nursery.start_soon(hold_the_engine_until_answered)
        await browser.call(browser.open, f"http://127.0.0.1:{proxy.port}/")
        await browser.call(lambda: browser.fill(**greedy(max_tokens=tokens)))
        await browser.call(browser.click, "start")
        status = await browser.call(browser.wait_status, "done")
        nursery.cancel_scope.cancel()

    assert proxy.statuses[0] == b"HTTP/1.1 200 "
    assert status == f"done: length, {tokens} tokens, resumed 1×"
    assert await browser.call(browser.text_of, "output") == expected
    log = await browser.call(browser.js, "return [...document.querySelectorAll('#log li')]"
                                         ".map((item) => item.textContent)")
    lost_after = int(log[0].removeprefix("connection lost after event ").split(";")[0])
    assert log == [f"connection lost after event {lost_after}; reconnecting",
                   f"reconnected, resumed at event {lost_after + 1}"]


async def test_stop_cancels_the_request_and_releases_its_blocks(
    server: RunningServer, browser: Browser
) -> None:
    recorder = server.recorder
    await browser.call(browser.open, server.base_url + "/")
    await browser.call(lambda: browser.fill(**greedy(max_tokens=480)))
    await browser.call(browser.click, "start")
    await server.wait_for(lambda: bool(recorder.submitted)
                          and len(recorder.token_ids_of(recorder.submitted[-1])) >= 2,
                          "the first tokens")
    request_id = recorder.submitted[-1]
    recorder.hold()  # it cannot finish while the page stops it
    await browser.call(browser.wait_for,
                       lambda: browser.text_of("tokens") != "0", "tokens on the page")
    await browser.call(browser.click, "stop")
    assert await browser.call(browser.wait_status, "stopped") == "stopped"
    recorder.release()

    finish = await server.wait_finished(request_id)
    assert finish.reason is FinishReason.CANCELLED
    await server.wait_for(lambda: server.app.runtime.statistics()["resumable_streams"] == 0,
                          "the registry to drop the stream")
    numbers = await stats(server)
    assert numbers["blocks_free"] == numbers["blocks_total"]
    assert numbers["resume_cancels"] == 1
    assert not await browser.call(lambda: browser.driver.find_element("id", "stop").is_enabled())


async def test_with_an_api_key_the_page_loads_and_streams_with_the_key(
    start_server: StartServer, browser: Browser
) -> None:
    key = "s3cret;key-0123456789abcdefghijklmnop"  # at least 32 characters
    server = await start_server(api_key=key)
    await browser.call(browser.open, server.base_url + "/")
    await browser.call(lambda: browser.fill(**greedy(max_tokens=4)))
    await browser.call(browser.click, "start")
    assert (await browser.call(browser.wait_status, "refused")).startswith(
        "refused: 401 unauthorized")

    await browser.call(lambda: browser.fill(api_key=key))
    await browser.call(browser.click, "start")
    assert await browser.call(browser.wait_status, "done") == "done: length, 4 tokens"
    # The stream is read with its own token, never the key in a cookie (browsers send a
    # cookie to every port of the host).
    source_url = await browser.call(browser.js, "return lastRun.source.url")
    request_id = await browser.call(browser.js, "return lastRun.id")
    assert f"/v1/stream/{request_id}?token=" in source_url
    assert re.fullmatch(r"[0-9]+\.[0-9a-f]{64}", source_url.partition("?token=")[2])
    assert "s3cret" not in source_url
    assert await browser.call(browser.js, "return document.cookie") == ""
