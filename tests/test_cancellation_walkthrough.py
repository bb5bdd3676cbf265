"""The worked examples and exercise solutions of ``docs/cancellation.md``, on Trio's mock clock.

The first example runs the whole app in-process: the real quart-trio app and its
``StreamingConnection``, the real routes, body, stream and hub, and the real engine on
tiny-gpt2. quart-trio's test connection plays hypercorn's part (it puts
``http.disconnect`` into the request's ASGI queue, as ``HTTPStream.handle`` does), and
each engine step runs inline in the Trio thread after costing ``STEP_S`` of virtual
time, so every assertion about time is exact. (The socket half, FIN and RST, is proven
over real loopback sockets in ``tests/test_app_disconnect.py``: a kernel does not run on
a mock clock.)

The exercises' solutions show each failure mode and the existing guard that catches it.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

import streams
import streams.hub
from app.factory import create_app
from app.quart_app import StreamscopeApp
from app.routes.body import EventStreamBody
from app.wire import NativeEvents
from engine import EngineEvent, FinishReason, GenerationRequest, SamplingParams, TokenEvent
from streams import Hub, SSEParser, StreamError, StreamItem, TokenStream
from streams.stream import StreamEnd, StreamState
from tests.fakes import STEP_S, ScriptedEngine, assert_settled, fixed_cost_step, open_hub, request
from tests.http_server import TEST_SETTINGS

if TYPE_CHECKING:
    from engine.engine import Engine

TOKENS_READ = 3  # the client reads this many token events, then leaves
LONG = 64  # max_new_tokens of a stream that is still running when its client leaves


# -- the walkthrough: one disconnect, from http.disconnect to the freed block ----------


class StepLog:
    """A ``run_step`` that costs ``STEP_S`` of virtual time, then steps inline, noting
    when each step ran and how many releases the engine had made after it."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.steps: list[tuple[float, int]] = []  # (virtual time, releases so far)
        self.first_release = trio.Event()

    async def __call__(self, fn: Callable[[], list[EngineEvent]]) -> list[EngineEvent]:
        await trio.sleep(STEP_S)
        events = fn()
        self.steps.append((trio.current_time(), self._engine.allocator.num_releases))
        if self._engine.allocator.num_releases:
            self.first_release.set()
        return events


@asynccontextmanager
async def open_app(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[StreamscopeApp, StepLog]]:
    """The app, started (lifespan) and ready, its hub stepping ``engine`` inline."""
    log = StepLog(engine)
    # Runtime builds the hub as ``streams.Hub(engine, settings)``: give it our run_step.
    monkeypatch.setattr(streams, "Hub", partial(Hub, run_step=log))
    app = create_app(TEST_SETTINGS, make_engine=lambda settings: engine)
    async with app.test_app():
        await app.runtime.loading_outcome()
        yield app, log


async def read_events(connection: object, count: int, into: list[str]) -> None:
    """Read SSE events from a quart test connection until ``count`` token events."""
    parser = SSEParser()
    while into.count("token") < count:
        chunk = await connection.receive()  # type: ignore[attr-defined]
        into.extend(event.event for event in parser.feed(chunk))


async def test_a_client_that_leaves_is_released_once_at_the_next_step_boundary(
    autojump_clock: trio.testing.MockClock,
    make_tiny_engine: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = TEST_SETTINGS
    engine = make_tiny_engine(max_batch=s.max_batch, num_blocks=s.cache_blocks,
                              block_size=s.block_size)
    body = {"prompt": "one two three", "max_new_tokens": LONG, "ignore_eos": True}
    async with open_app(engine, monkeypatch) as (app, steps):
        client = app.test_client()
        async with client.request("/v1/stream", method="POST",
                                  headers={"content-type": "application/json"}) as connection:
            await connection.send(json.dumps(body).encode())
            await connection.send_complete()
            events: list[str] = []
            await read_events(connection, TOKENS_READ, events)
            request_id = connection.headers["X-Request-ID"]  # type: ignore[attr-defined]
            made = len(engine.scheduler.find(request_id).generated_ids)  # type: ignore[union-attr]
            left_at = trio.current_time()
            await connection.disconnect()  # what hypercorn's HTTPStream.handle sends
            await steps.first_release.wait()
            finish = app.runtime.finished(request_id)
            assert finish is not None
            # quart-trio's test connection ends its client side only when the app sends
            # its last body or "http.disconnect"; for a client that left, neither comes
            # (hypercorn would close the socket). End it as hypercorn would.
            connection._client_send.close()  # type: ignore[attr-defined]
        hub = app.runtime.hub
        assert hub is not None
        hub_stats = hub.statistics()

    assert events[:1] == ["start"] and "done" not in events
    assert finish.reason is FinishReason.CANCELLED
    # The step in flight when the client left applied the cancel at its start: it made
    # no token for this request, and it was the first step after the disconnect.
    assert finish.completion_tokens == made
    released_at = next(t for t, releases in steps.steps if releases == 1)
    assert left_at < released_at <= left_at + STEP_S
    assert engine.allocator.num_releases == 1
    assert engine.allocator.num_free == engine.allocator.num_blocks
    # One close, and the FinishEvent found no stream any more: counted as dropped.
    assert (hub_stats.opened, hub_stats.closes, hub_stats.streams_open) == (1, 1, 0)
    assert hub_stats.events_dropped >= 1


async def test_cancelled_at_the_bodys_receive_closes_the_stream_with_no_checkpoint(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Steps 3 to 5 alone: the cancel lands in ``TokenStream.receive`` (parked, no item
    taken), unwinds through the body's ``__aexit__``, whose ``close()`` posts the
    engine cancel without a checkpoint; the next step applies it."""
    engine = ScriptedEngine()
    sent: list[bytes] = []
    closes_at: list[float] = []

    class TimedBody(EventStreamBody[StreamItem]):
        async def __aexit__(
            self, exc_type: type[BaseException] | None, exc: BaseException | None,
            tb: TracebackType | None,
        ) -> None:
            assert exc_type is trio.Cancelled  # it arrived at an await inside the block
            with trio.testing.assert_no_checkpoints():
                await super().__aexit__(exc_type, exc, tb)
            closes_at.append(trio.current_time())

    async with open_hub(engine) as hub:
        stream = hub.open_stream(request("a", LONG))
        with trio.CancelScope() as scope:  # the request's nursery scope, in the app
            async with trio.open_nursery() as nursery:
                body = TimedBody(stream, native_events(stream), keepalive_s=15.0)
                nursery.start_soon(quart_sends, body, sent)
                await trio.sleep(3.5 * STEP_S)
                scope.cancel(reason="client disconnected")
        assert stream.statistics().end is StreamEnd.CLIENT_GONE
        assert stream.state is StreamState.CLOSED
        assert closes_at == [3.5 * STEP_S]  # at once, in the cancelled scope
        assert engine.cancelled == ["a"] and engine.log == []  # a wish, not yet applied
        await trio.sleep(STEP_S)
        assert engine.log == [(4, "cancel", "a")]  # applied at the next step's start
    assert engine.releases["a"] == 1
    assert len(sent) == 1 + 3  # start, then the tokens of steps 1 to 3


def native_events(stream: TokenStream) -> NativeEvents:
    """``/v1/stream``'s encoder for ``stream``."""
    return NativeEvents(stream.request_id, stream.prompt_tokens)


async def quart_sends(body: EventStreamBody[StreamItem], sent: list[bytes]) -> None:
    """What ``quart.asgi:ASGIHTTPConnection._send_response`` does with a body."""
    async with body as chunks:
        async for chunk in chunks:
            sent.append(chunk)
            await trio.lowlevel.checkpoint()  # the send


# -- variant: a request that never ran, let go at its deadline ----------------------

DEADLINE_S = 8 * STEP_S  # of the engine's clock, which runs on Trio's virtual time here


async def test_a_request_still_waiting_at_its_deadline_is_let_go_without_a_block(
    autojump_clock: trio.testing.MockClock, make_tiny_engine: Callable[..., Engine],
) -> None:
    """Nobody cancels it: at a step boundary after its deadline the scheduler finishes
    it (DEADLINE) from the waiting queue; its stream ends with ``deadline_missed``."""
    # The engine reads deadlines against its own clock: here time.monotonic() as of its
    # construction, moved on by the virtual time the steps cost, so the deadline passes
    # after the 9th step on any machine. (The hub's check at open reads time.monotonic()
    # itself: it sees the 125 ms left, less the hub's start, under a millisecond here.)
    base = [0.0]  # time.monotonic() less the virtual time, once the engine is built
    engine = make_tiny_engine(max_batch=1, num_blocks=64, block_size=16,
                              clock=lambda: base[0] + autojump_clock.current_time())
    base[0] = time.monotonic() - autojump_clock.current_time()
    greedy_to_the_end = SamplingParams(ignore_eos=True)
    # The blocker holds the only batch slot for LONG steps, far more than the 9. Due
    # sooner than "late", it is admitted first (earliest deadline first within a band,
    # engine.priority) and, its prefill begun at the first step, never let go.
    blocker = GenerationRequest("blocker", "one two three", max_new_tokens=LONG,
                                sampling=greedy_to_the_end,
                                ttft_deadline=engine.scheduler.clock() + DEADLINE_S / 2)
    async with trio.open_nursery() as nursery:
        hub = Hub(engine, run_step=fixed_cost_step())
        await nursery.start(hub.run)
        running = hub.open_stream(blocker)
        late = GenerationRequest("late", "four five six", max_new_tokens=8,
                                 ttft_deadline=engine.scheduler.clock() + DEADLINE_S)
        with running, hub.open_stream(late) as waiting:
            items = [item async for item in waiting]
            assert running.state is StreamState.STREAMING  # the blocker runs on
            assert trio.current_time() == pytest.approx(9 * STEP_S)  # the 9th step let it go
        await hub.shutdown()
    assert items == [StreamError("deadline_missed", items[0].message)]  # type: ignore[union-attr]
    finish = hub.finished("late")
    assert finish is not None and finish.reason is FinishReason.DEADLINE
    assert finish.completion_tokens == 0
    assert hub.statistics().deadline_misses == 1
    # Never admitted: the only release is the blocker's (cancelled when its stream closed).
    assert engine.allocator.num_releases == 1
    assert engine.allocator.num_free == engine.allocator.num_blocks


# -- exercise 1: a close() that awaits -----------------------------------------------


class AwaitingCloseBody(EventStreamBody[StreamItem]):
    """The mistake: tidy up "asynchronously" before closing the stream."""

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await trio.lowlevel.checkpoint()  # e.g. flush a log, notify someone
        self.source.close()


async def test_exercise_1_a_close_that_awaits_leaves_the_stream_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_hub(engine) as hub:
        stream = hub.open_stream(request("a", LONG))
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                awaiting = AwaitingCloseBody(stream, native_events(stream), keepalive_s=15.0)
                nursery.start_soon(quart_sends, awaiting, [])
                await trio.sleep(3.5 * STEP_S)
                scope.cancel(reason="client disconnected")
        # Cancelled was raised again at the checkpoint in __aexit__, before close():
        # nobody closes the stream, and the engine generates on for a client that left.
        await trio.sleep(10 * STEP_S)
        assert stream.state is StreamState.STREAMING
        assert engine.cancelled == [] and engine.releases["a"] == 0
        assert hub.statistics().streams_open == 1
        # The guard (tests/test_routes_body.py::test_exit_makes_no_checkpoint) catches it.
        body = AwaitingCloseBody(stream, native_events(stream), keepalive_s=15.0)
        await body.__aenter__()
        with pytest.raises(AssertionError), trio.testing.assert_no_checkpoints():
            await body.__aexit__(None, None, None)
        assert stream.state is StreamState.CLOSED  # (the unguarded call did close it)


# -- exercise 2: a checkpoint between taking an item and returning it --------------


class CheckpointAfterTakeStream(TokenStream):
    """The mistake: an await after the item left the queue (say, to record it)."""

    async def receive(self) -> StreamItem:
        item = await super().receive()
        await trio.sleep(STEP_S / 2)  # e.g. await a metrics call
        return item


async def read_with_timeouts(hub: Hub, max_new_tokens: int) -> tuple[list[object], int]:
    """The guard's scenario (tests/test_stream.py::test_receive_under_move_on_after_loses_no_item):
    receive under a timeout shorter than a step, as the keep-alive does, until the
    engine is done; return what the reader got and how many items the stream gave out."""
    items: list[object] = []
    with hub.open_stream(request("a", max_new_tokens)) as stream:
        while stream.statistics().end is None or stream.statistics().queued:
            with trio.move_on_after(STEP_S / 3):
                items.append(await stream.receive())
        return items, stream.statistics().delivered


async def test_exercise_2_a_checkpoint_after_the_take_loses_items(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_hub(ScriptedEngine()) as hub:
        items, delivered = await read_with_timeouts(hub, 8)
    assert items[:-1] == [TokenEvent("a", i, i, f" t{i}") for i in range(8)]  # the guard
    assert delivered == len(items) == 9

    monkeypatch.setattr(streams.hub, "TokenStream", CheckpointAfterTakeStream)
    async with open_hub(ScriptedEngine()) as hub:
        items, delivered = await read_with_timeouts(hub, 8)
    # Each item was taken, then the timeout fired at the await: it is gone for good.
    assert delivered == 9 and len(items) < delivered
    with pytest.raises(AssertionError):  # the guard's assertion fails
        assert items[:-1] == [TokenEvent("a", i, i, f" t{i}") for i in range(8)]


# -- exercise 3: stop by cancelling the hub's task instead of draining it ---------------


async def test_exercise_3_cancelling_the_step_loop_leaves_the_cancels_unapplied(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    hub = Hub(engine, run_step=fixed_cost_step())
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.run)
        stream = hub.open_stream(request("a", LONG))
        await trio.sleep(3.5 * STEP_S)
        nursery.cancel_scope.cancel(reason="the server stops")
    with stream:
        items = [item async for item in stream]
    assert items[-1] == StreamError("shutdown", "the hub stopped")
    # The stream ended and asked the engine to cancel, but nobody steps it any more:
    # the wish stays in the inbox and the blocks stay held. The guard that open_hub
    # runs after every hub test (tests/fakes.py:assert_settled) catches it.
    assert engine.cancelled == ["a"] and engine.releases["a"] == 0
    with pytest.raises(AssertionError):
        assert_settled(engine, hub)

    engine = ScriptedEngine()  # the orderly way: shutdown() steps until the cache is whole
    async with open_hub(engine) as hub:  # (its exit calls shutdown, then assert_settled)
        stream = hub.open_stream(request("a", LONG))
        await trio.sleep(3.5 * STEP_S)
        hub.drain()
        with stream:
            items = [item async for item in stream]
    assert engine.releases["a"] == 1

