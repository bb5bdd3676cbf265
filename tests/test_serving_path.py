"""The per-token path made cheap (issue 21): steps ahead of the loop, coalesced writes.

The hub's stepping thread (``streams/stepper.py``) steps while the loop writes, holds
steps' events while writers are busy and routes them a stride at a time; a body writes
every queued item in one chunk, each its own event; the token event is built by hand.
Each test here fails if its piece is taken out. Real threads where the thread matters
(the checks are on order and counts, never on timing); virtual time elsewhere.
"""

from __future__ import annotations

import json
import socket
from functools import partial

import trio
from hypothesis import given
from hypothesis import strategies as st

from app.edge import body_hot_path
from app.routes.body import EventStreamBody
from app.wire import NativeEvents, encode_json_event, item_event, token_event
from engine import FinishEvent, TokenEvent
from streams import Hub, HubSettings, PolicyName, SSEParser, StreamState
from streams.stepper import DEFAULT_STEPS_AHEAD
from tests.fakes import STEP_S, ScriptedEngine, open_hub, request
from tests.http_clients import RawClient, count_tokens, parse_sse, stream_body
from tests.http_server import RunningServer, StartServer
from tools.lab._app import create_lab_app
from tools.lab._settings import LabSettings


@given(st.text(), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(1, 10**9))
def test_the_token_event_is_the_generic_encoding_byte_for_byte(
    text: str, index: int, token_id: int, event_id: int
) -> None:
    item = TokenEvent("r", index, token_id, text)
    assert token_event(event_id, item) == encode_json_event("token", event_id,
                                                           item_event(item)[1])


async def test_a_body_writes_every_queued_item_in_one_chunk_each_its_own_event(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_hub(engine) as hub:
        stream = hub.open_stream(request("a", max_new_tokens=3))
        await trio.sleep(10 * STEP_S)  # every token made and queued; nobody read yet
        chunks = []
        encoder = NativeEvents(stream.request_id, stream.prompt_tokens)
        async with EventStreamBody(stream, encoder, keepalive_s=60.0) as body:
            async for chunk in body:
                chunks.append(chunk)
    events = [SSEParser().feed(chunk) for chunk in chunks]

    assert [[e.event for e in chunk] for chunk in events] == [
        ["start"], ["token", "token", "token", "done"]]
    assert [e.id for e in events[1]] == ["2", "3", "4", "5"]
    assert [json.loads(e.data)["index"] for e in events[1][:3]] == [0, 1, 2]


async def test_steps_run_ahead_of_a_busy_writer_and_reach_it_a_stride_at_a_time() -> None:
    # Nobody reads the stream, so its writer stays busy: the hub holds the steps' tokens
    # until DEFAULT_STEPS_AHEAD steps are held and routes them together (the thread is
    # never more steps ahead than that). The first token (a prefill's) is never held.
    # The queue's length is recorded at every routing, whenever the thread gets there.
    tokens = 1 + 5 * DEFAULT_STEPS_AHEAD
    engine = ScriptedEngine()
    settings = HubSettings(policy=PolicyName.UNBOUNDED)
    queued_at_routing: list[int] = []
    async with open_hub(engine, settings, run_step=trio.to_thread.run_sync) as hub:
        release = hub._stepper.release
        with hub.open_stream(request("a", max_new_tokens=tokens)) as stream:

            def recording_release() -> None:
                routings = hub._stepper.routings
                release()
                if hub._stepper.routings > routings:
                    queued_at_routing.append(stream.statistics().queued)

            hub._stepper.release = recording_release  # type: ignore[method-assign]
            with trio.fail_after(10):
                while stream.statistics().state is not StreamState.ENDED:  # noqa: ASYNC110
                    await trio.sleep(0.001)  # (a thread steps)
            items = [item async for item in stream]
    # the last routing: its four last tokens and the finish (made by the same step)
    assert queued_at_routing == [1 + DEFAULT_STEPS_AHEAD * n for n in range(5)] + [tokens + 1]
    assert [item.index for item in items[:-1]] == list(range(tokens))  # type: ignore[union-attr]
    assert isinstance(items[-1], FinishEvent)


async def test_a_cancelled_hub_stops_its_stepping_thread_after_the_step_in_flight() -> None:
    engine = ScriptedEngine(blocks_total=10**6)  # room for a request that never ends
    settings = HubSettings(policy=PolicyName.UNBOUNDED)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            hub = Hub(engine, settings)
            await nursery.start(hub.run)
            stream = hub.open_stream(request("a", max_new_tokens=10**6))
            while engine.steps < 20:  # noqa: ASYNC110 (a thread steps)
                await trio.sleep(0.001)
            nursery.cancel_scope.cancel()
    steps = engine.steps
    await trio.sleep(0.05)
    assert engine.steps == steps  # nobody steps after run() returned
    assert stream.statistics().end is not None  # ended with StreamError shutdown
    stream.close()


async def test_a_streamed_body_is_written_the_direct_way_in_valid_chunks(
    server: RunningServer,
) -> None:
    # httpx reads the body through h11, which refuses a malformed chunk; every event is
    # there and in order, and the hot path wrote the body's messages (app/edge/body_hot_path.py).
    before = body_hot_path.direct_writes
    async with server.client() as client:
        response = await client.post("/v1/stream", json=stream_body(max_new_tokens=12,
                                                                    ignore_eos=True))
    events = parse_sse(response.content)

    assert [e.event for e in events] == ["start"] + ["token"] * 12 + ["done"]
    assert [e.id for e in events] == [str(n) for n in range(1, 15)]
    assert body_hot_path.direct_writes - before >= 2  # the start event, then token writes


async def test_a_chunk_the_socket_takes_only_in_part_still_goes_out_whole_and_in_order(
    start_server: StartServer,
) -> None:
    # The lab's padded events (64 KiB of comment each) to a reader that reads nothing yet,
    # behind a small receive buffer: the server's socket fills, a direct write is taken
    # in part and its rest goes by send_all; h11 parses every chunk of the body (a cut
    # or repeated chunk would break its framing).
    server = await start_server(create=partial(create_lab_app, lab=LabSettings(pad_bytes=65536)))
    before = body_hot_path.partial_writes
    client = RawClient(server.host, server.port)
    client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await client.post("/v1/stream", stream_body(max_new_tokens=120, ignore_eos=True))
    with trio.fail_after(60):
        while body_hot_path.partial_writes == before:  # noqa: ASYNC110  (a counter, no event)
            await trio.sleep(0.01)
    await client.read_until(lambda events: count_tokens(events) >= 1)
    await client.read_to_end()
    await client.close_clean()

    assert [e.event for e in client.events] == ["start"] + ["token"] * 120 + ["done"]
    assert [e.id for e in client.events] == [str(n) for n in range(1, 123)]
    indexes = [json.loads(e.data)["index"] for e in client.events if e.event == "token"]
    assert indexes == list(range(120))
