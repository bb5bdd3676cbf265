"""A client that leaves, and a server that stops, over real HTTP (raw sockets, h11).

The bound on wasted work: ``RecordingEngine`` notes how many tokens a request had been
given when ``engine.cancel`` was called (by ``stream.close()``, in the Trio thread). A
step in flight at that moment may still add one token to it (one token per sequence
per step); the next step applies the cancel at its start. So a cancelled request has at
most ``mark + 1`` tokens: it was cancelled within one step.

A long stream (``long_body``: 480 tokens, under half a second here) is still running when
its client leaves on any machine: the engine runs at most a few steps (the hub's
``steps_ahead``) ahead of the event loop that also carries the reader's socket, not
hundreds; where a test also waits for the server to notice, the engine's steps are held
(``RecordingEngine.hold``) meanwhile.
"""

from __future__ import annotations

import pytest

from engine import FinishReason
from tests.http_clients import LONG_MAX_NEW_TOKENS, RawClient, long_body
from tests.http_server import RunningServer, StartServer

TOKENS_READ = 3  # the client reads this many token events, then leaves


async def open_long_stream(server: RunningServer, tokens: int = TOKENS_READ) -> RawClient:
    client = server.raw_client()
    await client.post("/v1/stream", long_body())
    await client.read_tokens(tokens)
    return client


@pytest.mark.parametrize("how", ["fin", "rst"])
async def test_client_that_leaves_is_cancelled_within_one_step(
    server: RunningServer, how: str
) -> None:
    client = await open_long_stream(server)
    request_id = client.request_id()
    server.recorder.hold()  # the stream cannot end before the server notices it is gone

    if how == "fin":
        await client.close_clean()
    else:
        client.close_abort()
    await server.wait_for(lambda: request_id in server.recorder.cancel_marks, "the cancel")
    server.recorder.release()
    finish = await server.wait_finished(request_id)

    mark = server.recorder.cancel_marks[request_id]
    assert finish.reason is FinishReason.CANCELLED
    assert TOKENS_READ <= finish.completion_tokens <= mark + 1
    assert finish.completion_tokens < LONG_MAX_NEW_TOKENS
    await server.wait_for(lambda: server.hub.statistics().streams_open == 0, "stream closed")
    stats = server.recorder.statistics()
    assert (stats.releases, stats.blocks_free) == (1, stats.blocks_total)


async def test_request_waiting_for_a_slot_is_never_admitted_if_its_client_leaves(
    start_server: StartServer,
) -> None:
    server = await start_server(max_batch=1)
    first = await open_long_stream(server, tokens=1)  # holds the only batch slot
    second = server.raw_client()
    await second.post("/v1/stream", long_body())
    await second.read_until(lambda events: [e.event for e in events] == ["start"])
    waiting_id = second.request_id()
    assert server.hub.statistics().waiting == 1

    second.close_abort()
    # The cancel needs a step, so the first decodes on meanwhile: for a step and a poll
    # (5 ms) of wait_finished, which its 480 tokens outlast on any machine.
    finish = await server.wait_finished(waiting_id)

    assert (finish.reason, finish.completion_tokens) == (FinishReason.CANCELLED, 0)
    assert server.recorder.token_ids_of(waiting_id) == []
    assert server.recorder.finish_of(first.request_id()) is None  # still holding the slot
    assert server.recorder.statistics().releases == 0  # so nothing was released yet
    first.close_abort()
    await server.wait_finished(first.request_id())
    assert server.recorder.admitted() == {first.request_id()}


async def test_generate_is_cancelled_when_its_client_leaves(server: RunningServer) -> None:
    client = server.raw_client()
    await client.post("/v1/generate", long_body())
    await server.wait_for(lambda: len(server.recorder.submitted) == 1, "the request submitted")
    (request_id,) = server.recorder.submitted
    await server.wait_for(lambda: len(server.recorder.token_ids_of(request_id)) >= TOKENS_READ,
                          "a few tokens generated")
    server.recorder.hold()  # the request cannot end before the server notices it is gone

    client.close_abort()
    await server.wait_for(lambda: request_id in server.recorder.cancel_marks, "the cancel")
    server.recorder.release()
    finish = await server.wait_finished(request_id)

    assert finish.reason is FinishReason.CANCELLED
    assert finish.completion_tokens <= server.recorder.cancel_marks[request_id] + 1
    assert finish.completion_tokens < LONG_MAX_NEW_TOKENS


async def test_stream_open_at_shutdown_gets_error_shutdown_and_cache_ends_whole(
    start_server: StartServer,
) -> None:
    server = await start_server(graceful_timeout_s=0.2)
    client = await open_long_stream(server, tokens=1)
    server.recorder.hold()  # the stream stays open, idle, past hypercorn's grace period

    server.stop()
    await client.read_until(lambda events: events[-1].event == "error")
    server.recorder.release()
    await server.wait_stopped()

    error = client.events[-1]
    assert error.data == '{"error":{"type":"shutdown","message":"the server is stopping"}}'
    assert int(error.id) == len(client.events)
    stats = server.recorder.statistics()
    assert stats.blocks_free == stats.blocks_total
    assert server.hub.statistics().streams_open == 0
    assert server.recorder.finish_of(client.request_id()) is not None
    await client.read_to_end()  # the chunked body was terminated properly
