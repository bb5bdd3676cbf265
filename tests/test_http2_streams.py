"""HTTP/2 over TLS with real clients (issue 25, item 2): many streams on one connection,
a reset stream is a disconnect, a closed connection cancels all of its streams, and the
keep-alive, resumption and the OpenAI SDK work as over HTTP/1.1.

The server is hypercorn with a certificate made by ``openssl`` at test time
(the ``start_tls`` fixture): it offers ``h2`` by ALPN. httpx (``http2=True``),
``curl --http2`` and the OpenAI SDK over httpx are the clients where they can do what a
test needs; ``H2Client`` (the ``h2`` library on a Trio TLS stream) where only a raw
client can: a reset of one stream, a FIN or an RST under a connection with streams on it.

The bound on wasted work is ``test_app_disconnect.py``'s: a cancelled request has at most
one token more than it had when ``engine.cancel`` was called.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import trio

from engine import FinishReason
from streams.resume import Holding
from tests.http2_clients import H2Client, H2Stream, h2_client, token_ids
from tests.http_clients import LONG_MAX_NEW_TOKENS, long_body, parse_sse, stream_body
from tests.http_server import RunningServer, StartServer
from tests.tls import Certificate

CONCURRENT = 32
TOKENS_READ = 3


@pytest.fixture
async def tls_server(start_tls: StartServer) -> RunningServer:
    return await start_tls(max_batch=8)


async def read_tokens(client: H2Client, stream: H2Stream, count: int) -> None:
    await client.read_until(lambda: len(stream.tokens()) >= count)


async def test_32_streams_on_one_connection_equal_their_solo_runs(
    tls_server: RunningServer, certificate: Certificate
) -> None:
    bodies = [stream_body(prompt=f"Story {i}:", max_new_tokens=12, ignore_eos=True,
                          temperature=0.8, seed=i) for i in range(CONCURRENT)]
    connections: set[int] = set()

    async def tokens_of(http: httpx.AsyncClient, body: dict[str, Any]) -> list[int]:
        response = await http.post("/v1/stream", json=body)
        assert (response.status_code, response.http_version) == (200, "HTTP/2")
        connections.add(id(response.extensions["network_stream"]))
        return token_ids(parse_sse(response.content))

    async with h2_client(tls_server, certificate) as http:
        solo = [await tokens_of(http, body) for body in bodies]
    together: list[list[int]] = [[] for _ in bodies]
    connections.clear()
    async with h2_client(tls_server, certificate) as http:

        async def run(i: int) -> None:
            together[i] = await tokens_of(http, bodies[i])

        async with trio.open_nursery() as nursery:
            for i in range(CONCURRENT):
                nursery.start_soon(run, i)

    assert len(connections) == 1  # every stream on one HTTP/2 connection
    assert all(len(tokens) == 12 for tokens in solo)
    assert together == solo
    assert len(set(map(tuple, solo))) > 1  # the seeds made different streams


async def test_a_reset_stream_is_cancelled_within_one_step_and_its_neighbours_go_on(
    tls_server: RunningServer, certificate: Certificate
) -> None:
    client = await H2Client.connect(tls_server, certificate)
    gone, neighbour = [await client.post("/v1/stream", long_body()) for _ in range(2)]
    await read_tokens(client, gone, TOKENS_READ)
    request_id = gone.request_id()
    tls_server.recorder.hold()  # the stream cannot end before the server notices the reset

    await client.reset(gone)
    await tls_server.wait_for(lambda: request_id in tls_server.recorder.cancel_marks,
                              "the cancel")
    tls_server.recorder.release()
    finish = await tls_server.wait_finished(request_id)

    mark = tls_server.recorder.cancel_marks[request_id]
    assert finish.reason is FinishReason.CANCELLED
    assert TOKENS_READ <= finish.completion_tokens <= mark + 1 < LONG_MAX_NEW_TOKENS
    assert tls_server.recorder.statistics().releases == 1  # its blocks, once
    # The connection and the other stream are untouched: it runs to its end, and a new
    # stream on the same connection is answered.
    late = await client.post("/v1/stream", stream_body(max_new_tokens=4, ignore_eos=True))
    await client.read_until(lambda: neighbour.ended and late.ended)
    assert neighbour.reset is None and neighbour.status == 200
    assert neighbour.events[-1].event == "done" and len(neighbour.tokens()) == LONG_MAX_NEW_TOKENS
    assert [e.event for e in late.events] == ["start"] + ["token"] * 4 + ["done"]
    assert client.goaway is None
    await client.close_clean()


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_a_connection_that_closes_cancels_all_of_its_streams(
    tls_server: RunningServer, certificate: Certificate, how: str
) -> None:
    client = await H2Client.connect(tls_server, certificate)
    streams = [await client.post("/v1/stream", long_body()) for _ in range(3)]
    await client.read_until(lambda: all(len(s.tokens()) >= 1 for s in streams))
    ids = [s.request_id() for s in streams]
    tls_server.recorder.hold()

    if how == "fin":
        async with trio.open_nursery() as nursery:  # reads to the server's EOF meanwhile
            nursery.start_soon(client.close_clean)
            await tls_server.wait_for(
                lambda: all(i in tls_server.recorder.cancel_marks for i in ids), "the cancels")
    else:
        client.close_abort()
        await tls_server.wait_for(
            lambda: all(i in tls_server.recorder.cancel_marks for i in ids), "the cancels")
    tls_server.recorder.release()

    for request_id in ids:
        finish = await tls_server.wait_finished(request_id)
        assert finish.reason is FinishReason.CANCELLED
        assert finish.completion_tokens <= tls_server.recorder.cancel_marks[request_id] + 1
    await tls_server.wait_for(lambda: tls_server.hub.statistics().streams_open == 0,
                              "the streams closed")
    assert tls_server.recorder.statistics().releases == 3


async def test_a_clients_fin_closes_the_connection_at_once(
    tls_server: RunningServer, certificate: Certificate
) -> None:
    client = await H2Client.connect(tls_server, certificate)
    answered = await client.get("/health")
    await client.read_until(lambda: answered.ended)

    with trio.fail_after(1.0):  # hypercorn alone: when its keep-alive timer fires (5 s here)
        await client.close_clean()


async def test_keepalive_comments_come_on_a_quiet_http2_stream(
    start_tls: StartServer, certificate: Certificate
) -> None:
    server = await start_tls(keepalive_s=0.2)
    client = await H2Client.connect(server, certificate)
    stream = await client.post("/v1/stream", long_body())
    await read_tokens(client, stream, 1)
    server.recorder.hold()  # quiet: no token comes

    await client.read_until(lambda: b": keep-alive\n" in stream.raw)
    server.recorder.release()
    await client.read_until(lambda: stream.ended)

    assert stream.events[-1].event == "done"
    assert len(stream.tokens()) == LONG_MAX_NEW_TOKENS


async def test_last_event_id_resumes_a_stream_over_http2(
    tls_server: RunningServer, certificate: Certificate
) -> None:
    body = stream_body(max_new_tokens=12, ignore_eos=True, resumable=True)
    async with h2_client(tls_server, certificate) as http:
        whole = parse_sse((await http.post("/v1/stream", json=body)).content)
    client = await H2Client.connect(tls_server, certificate)
    first = await client.post("/v1/stream", body)
    await client.read_until(lambda: len(first.events) >= 5)
    request_id, received = first.request_id(), first.events[:5]
    await client.reset(first)  # this reader leaves; the stream is held for a resume
    registry = tls_server.app.runtime.resumption
    assert registry is not None
    await tls_server.wait_for(lambda: registry.holding(request_id) is Holding.DETACHED,
                              "the stream detached")

    async with h2_client(tls_server, certificate) as http:
        response = await http.get(f"/v1/stream/{request_id}",
                                  headers={"Last-Event-ID": f"{request_id}:5"})
    rest = parse_sse(response.content)

    assert (response.status_code, response.http_version) == (200, "HTTP/2")
    assert [e.id for e in received + rest] == [f"{request_id}:{n}"
                                               for n in range(1, len(whole) + 1)]
    assert token_ids(received + rest) == token_ids(whole)
    assert rest[-1].event == "done"
    await client.close_clean()


async def test_the_openai_sdk_streams_over_httpx_http2(
    tls_server: RunningServer, certificate: Certificate
) -> None:
    versions: list[str] = []

    async def note_version(response: httpx.Response) -> None:
        versions.append(response.http_version)

    http = h2_client(tls_server, certificate, event_hooks={"response": [note_version]})
    async with http, openai.AsyncOpenAI(base_url=f"{tls_server.base_url}/v1", api_key="none",
                                        http_client=http, max_retries=0) as sdk:
        stream = await sdk.completions.create(model="tiny-gpt2", prompt="The capital of",
                                              max_tokens=6, stream=True)
        chunks = [chunk async for chunk in stream]

    assert versions == ["HTTP/2"]
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


async def test_curl_http2_reads_a_stream(
    tls_server: RunningServer, certificate: Certificate
) -> None:
    features = (await trio.run_process(["curl", "-V"], capture_stdout=True)).stdout.decode()
    assert "HTTP2" in features.split("Features:")[-1], f"this curl has no HTTP/2: {features}"
    body = json.dumps(stream_body(max_new_tokens=5, ignore_eos=True))
    done = await trio.run_process(
        ["curl", "-sS", "--http2", "--cacert", str(certificate.cert), "-N",
         "-H", "content-type: application/json", "-d", body,
         "-w", "\\nhttp_version=%{http_version}", f"{tls_server.base_url}/v1/stream"],
        capture_stdout=True, capture_stderr=True, check=False)

    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    sse, _, version = out.rpartition("\nhttp_version=")
    assert version == "2"
    assert [e.event for e in parse_sse(sse.encode())] == ["start"] + ["token"] * 5 + ["done"]


async def curl(*args: str) -> tuple[str, str]:
    """curl's body and the HTTP version it spoke."""
    done = await trio.run_process(
        ["curl", "-sS", "-N", "-w", "\nhttp_version=%{http_version}", *args],
        capture_stdout=True, capture_stderr=True, check=False)
    assert done.returncode == 0, done.stderr.decode()
    body, _, version = done.stdout.decode().rpartition("\nhttp_version=")
    return body, version


async def test_http2_in_the_clear_by_prior_knowledge_or_an_h2c_upgrade(
    server: RunningServer,
) -> None:
    body = json.dumps(stream_body(max_new_tokens=3, ignore_eos=True))
    sse, by_knowledge = await curl("--http2-prior-knowledge", "-H",
                                   "content-type: application/json", "-d", body,
                                   f"{server.base_url}/v1/stream")
    health, by_upgrade = await curl("--http2", f"{server.base_url}/health")

    assert (by_knowledge, by_upgrade) == ("2", "2")
    assert [e.event for e in parse_sse(sse.encode())] == ["start"] + ["token"] * 3 + ["done"]
    assert json.loads(health)["phase"] == "ready"
