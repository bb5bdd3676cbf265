"""GOAWAY when the server drains, and after ``keep_alive_max_requests`` (issue 25, item 2).

``h2_retire.goaway_on_drain`` (started beside the server, as ``streamscope serve`` starts
it) retires every HTTP/2 connection once the runtime drains: one with no stream running
gets GOAWAY ``NO_ERROR`` and is closed at once; one with streams running serves them to
their end (or the drain's last event) and answers new requests as over HTTP/1.1 (503
``shutdown``), and then gets the GOAWAY. Not at once: the ``h2`` library under httpx
fails every stream still running on a connection that got a GOAWAY (python-hyper/h2#1181),
which ``test_httpx_streams_survive_a_drain`` would show. And where hypercorn's own stop
closes an idle connection before the drain has retired it, the GOAWAY goes out first
(hypercorn alone sent none).

``tests/test_tls_serve.py`` has the same through SIGTERM to ``streamscope serve``.
"""

from __future__ import annotations

import json

import trio

from tests.http2_clients import H2Client, h2_client
from tests.http_clients import long_body, parse_sse, stream_body
from tests.http_server import StartServer
from tests.tls import Certificate

PACE_S = 0.005  # a long stream then runs for 480 * 5 ms at least, past the drain's start


async def test_an_idle_connection_gets_goaway_when_the_server_drains(
    start_tls: StartServer, certificate: Certificate
) -> None:
    server = await start_tls(goaway_on_drain=True)
    client = await H2Client.connect(server, certificate)
    answered = await client.post("/v1/stream", stream_body(max_new_tokens=2))
    await client.read_until(lambda: answered.ended)

    server.app.runtime.drain("the test drains it")
    await client.read_to_eof()

    assert client.goaway is not None
    assert (client.goaway.error_code, client.goaway.last_stream_id) == (0, 1)
    assert client.goaway.additional_data == b"drain"


async def test_an_idle_connection_gets_goaway_when_hypercorn_itself_stops_first(
    start_tls: StartServer, certificate: Certificate
) -> None:
    server = await start_tls()  # no goaway_on_drain: only hypercorn's own stop closes it
    client = await H2Client.connect(server, certificate)
    answered = await client.post("/v1/stream", stream_body(max_new_tokens=2))
    await client.read_until(lambda: answered.ended)

    server.stop()
    await client.read_to_eof()

    assert client.goaway is not None  # hypercorn alone closed it with none
    assert (client.goaway.error_code, client.goaway.last_stream_id) == (0, 1)
    assert client.goaway.additional_data == b"the server is stopping"


async def test_a_busy_connection_finishes_its_streams_then_gets_goaway(
    start_tls: StartServer, certificate: Certificate
) -> None:
    # A grace the stream's 480 paced steps never meet, however busy the machine (the
    # default 5 s was met at a load average of 10): the drain waits for the stream's end.
    server = await start_tls(goaway_on_drain=True, shutdown_grace_s=120)
    server.recorder.pace(PACE_S)
    client = await H2Client.connect(server, certificate)
    running = await client.post("/v1/stream", long_body())
    await client.read_until(lambda: len(running.tokens()) >= 1)

    server.app.runtime.drain("the test drains it")
    refused = await client.post("/v1/stream", stream_body(max_new_tokens=2))
    await client.read_until(lambda: refused.ended)
    assert client.goaway is None  # not while a stream runs
    await client.read_to_eof()

    assert refused.status == 503 and refused.headers["retry-after"] == "1"
    assert json.loads(refused.raw)["error"]["type"] == "shutdown"
    assert running.events[-1].event == "done" and len(running.tokens()) == 480
    assert client.goaway is not None
    assert (client.goaway.error_code, client.goaway.last_stream_id) == (0, 3)


async def test_a_stream_past_the_drain_deadline_gets_the_last_event_then_goaway(
    start_tls: StartServer, certificate: Certificate
) -> None:
    server = await start_tls(goaway_on_drain=True, shutdown_grace_s=0.3)
    client = await H2Client.connect(server, certificate)
    held = await client.post("/v1/stream", long_body())
    await client.read_until(lambda: len(held.tokens()) >= 1)
    server.recorder.hold()  # it cannot finish before the deadline

    server.app.runtime.drain("the test drains it")
    await client.read_until(lambda: held.ended)
    server.recorder.release()
    await client.read_to_eof()

    error = held.events[-1]
    assert error.event == "error"
    assert json.loads(error.data)["error"]["type"] == "shutdown"
    assert client.goaway is not None and client.goaway.error_code == 0


async def test_httpx_streams_survive_a_drain(
    start_tls: StartServer, certificate: Certificate
) -> None:
    # A grace the stream's 480 paced steps never meet, however busy the machine: the
    # drain waits for the stream's end, not for the grace.
    server = await start_tls(goaway_on_drain=True, shutdown_grace_s=120)
    server.recorder.pace(PACE_S)
    async with h2_client(server, certificate) as http:
        async with http.stream("POST", "/v1/stream", json=long_body()) as response:
            assert response.http_version == "HTTP/2"
            chunks = response.aiter_bytes()
            raw = await anext(chunks)
            server.app.runtime.drain("the test drains it")
            refused = await http.post("/v1/stream", json=stream_body(max_new_tokens=2))
            async for chunk in chunks:
                raw += chunk
        events = parse_sse(raw)
        with trio.fail_after(5):  # the server closed that connection: a new one, refused
            again = await http.post("/v1/stream", json=stream_body(max_new_tokens=2))

    assert (refused.status_code, refused.http_version) == (503, "HTTP/2")
    assert events[-1].event == "done"
    assert len([e for e in events if e.event == "token"]) == 480
    assert again.status_code == 503
