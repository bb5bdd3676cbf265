"""The browser over HTTP/2 (issue 25, item 4): headless Chromium opens 12 ``EventSource``s
to the server at once, over TLS with a certificate made by ``openssl`` at test time (and
``--ignore-certificate-errors``, Chromium's flag that accepts it).

Over HTTP/2 they are 12 streams of one connection: every one's first token comes within
the same burst. Over HTTP/1.1 (the same server with ALPN ``http/1.1`` only) Chromium holds
at most six connections to a host: the seventh EventSource waits until one of the six
streams has ended, which is the reason to serve HTTP/2.

The 12 streams are resumable (``POST /v1/requests``, then each EventSource GETs its
``stream_url``): they generate from their creation on, paced (``RecordingEngine.pace``) so
that each takes ``STREAM_S`` however fast the machine. The page records when each
EventSource got its first token, in milliseconds from the moment it opened them all.
Debian's Chromium and chromedriver as in ``test_browser_page.py`` (CI installs them).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import trio

from tests.browser import CHROMEDRIVER, CHROMIUM, headless_chromium
from tests.http2_clients import h2_client
from tests.http_clients import stream_body
from tests.http_server import RunningServer, StartServer
from tests.test_browser_page import INSTALL, Browser
from tests.tls import Certificate

EVENT_SOURCES = 12
TOKENS = 150
PACE_S = 0.01
STREAM_S = TOKENS * PACE_S  # a stream's length at the least: 1.5 s
OPEN_ALL = """
const urls = arguments[0];
window.firsts = new Array(urls.length).fill(null);
window.ends = 0;
const t0 = performance.now();
urls.forEach((url, i) => {
  const source = new EventSource(url);
  source.addEventListener("token", () => {
    if (window.firsts[i] === null) window.firsts[i] = performance.now() - t0;
  });
  const end = () => { source.close(); window.ends += 1; };
  source.addEventListener("done", end);
  source.addEventListener("error", end);
});
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: the browser tests need Debian's "
                    f"Chromium; install it with: {INSTALL}", pytrace=False)
    with headless_chromium("--ignore-certificate-errors") as driver:
        yield Browser(driver)


async def first_tokens(
    server: RunningServer, certificate: Certificate, browser: Browser
) -> tuple[str, list[float]]:
    """The page's protocol, and when each of 12 EventSources got its first token (ms)."""
    server.recorder.pace(PACE_S)
    await browser.call(browser.open, f"{server.base_url}/")
    protocol = await browser.call(
        browser.js, "return performance.getEntriesByType('navigation')[0].nextHopProtocol")
    body = stream_body(max_new_tokens=TOKENS, ignore_eos=True)
    async with h2_client(server, certificate) as http:
        created = [await http.post("/v1/requests", json=body) for _ in range(EVENT_SOURCES)]
    urls = [f"{server.base_url}{c.json()['stream_url']}" for c in created]

    await browser.call(browser.js, OPEN_ALL, urls)
    with trio.fail_after(STREAM_S * EVENT_SOURCES + 10):
        while await browser.call(browser.js, "return window.ends") < EVENT_SOURCES:  # noqa: ASYNC110
            await trio.sleep(0.05)
    firsts = await browser.call(browser.js, "return window.firsts")
    assert None not in firsts, firsts
    return str(protocol), sorted(firsts)


async def test_over_http2_twelve_event_sources_get_their_first_tokens_in_one_burst(
    start_tls: StartServer, certificate: Certificate, browser: Browser
) -> None:
    server = await start_tls(max_batch=16)

    protocol, firsts = await first_tokens(server, certificate, browser)

    assert protocol == "h2"
    assert firsts[-1] - firsts[0] < 1000 * STREAM_S / 3, firsts  # all 12 at once


async def test_over_http11_the_seventh_event_source_waits_for_a_stream_to_end(
    start_tls: StartServer, certificate: Certificate, browser: Browser
) -> None:
    server = await start_tls(max_batch=16, hypercorn={"alpn_protocols": ["http/1.1"]})

    protocol, firsts = await first_tokens(server, certificate, browser)

    assert protocol == "http/1.1"
    assert firsts[5] - firsts[0] < 1000 * STREAM_S / 3, firsts  # six connections at once
    assert firsts[6] - firsts[0] > 1000 * STREAM_S / 2, firsts  # the seventh: after one ended
