"""The app's one keep-alive timer (``streams/keepalive.py``): a body that waits on a
TokenStream sends its keep-alive after one to 1.25 intervals of quiet, with no timeout
scope per wait, and loses nothing to a nudge. Trio's virtual clock throughout."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from app.routes.body import EventStreamBody
from app.wire import KEEPALIVE_COMMENT, NativeEvents
from engine import FinishEvent, FinishReason, TokenEvent
from streams import Keepalives, PolicyName, StreamItem, TokenStream
from streams.policy import Policy

INTERVAL_S = 15.0


class Owner:
    """A stream's control that records cancels and unregisters (no hub)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause(self, request_id: str) -> None: ...
    def resume(self, request_id: str) -> None: ...
    def watch(self, deadline: float) -> None: ...
    def writing(self, stream: TokenStream) -> None: ...
    def written(self, stream: TokenStream) -> None: ...

    def cancel(self, request_id: str) -> None:
        self.calls.append("cancel")

    def unregister(self, stream: TokenStream) -> None:
        self.calls.append("unregister")


def token(index: int) -> TokenEvent:
    return TokenEvent("a", index, 100 + index, f"t{index}")


def new_stream(owner: Owner | None = None) -> TokenStream:
    return TokenStream("a", 4, Policy(PolicyName.UNBOUNDED), owner or Owner())


async def send_body(body: EventStreamBody[StreamItem], sent: list[tuple[float, bytes]]) -> None:
    """What quart's ``_send_response`` does with a ResponseBody, with a timestamp."""
    async with body as chunks:
        async for chunk in chunks:
            sent.append((trio.current_time(), chunk))


async def test_a_body_on_the_timer_sends_a_keepalive_after_an_interval_of_quiet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    keepalives = Keepalives(INTERVAL_S)
    stream = new_stream()
    body = EventStreamBody(stream, NativeEvents("a", 4), keepalive_s=INTERVAL_S,
                           keepalives=keepalives)
    sent: list[tuple[float, bytes]] = []

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keepalives.run)
        nursery.start_soon(send_body, body, sent)
        await trio.sleep(40.0)
        stream.deliver(token(0))
        await trio.sleep(1.0)
        stream.deliver(token(1))
        stream.deliver(FinishEvent("a", FinishReason.LENGTH, 4, 2))
        await trio.sleep(INTERVAL_S * 2)
        nursery.cancel_scope.cancel()

    # The timer looks every quarter interval (3.75 s): the waits that began at 0 and at
    # 15 are due at 15 and 30 exactly; nothing goes out after the finish.
    assert [(t, chunk == KEEPALIVE_COMMENT) for t, chunk in sent] == [
        (0.0, False), (15.0, True), (30.0, True), (40.0, False), (41.0, False)
    ]
    assert keepalives.nudges == 2
    assert b"event: done" in sent[-1][1]


async def test_a_wait_that_began_between_ticks_is_nudged_within_a_quarter_interval_late(
    autojump_clock: trio.testing.MockClock,
) -> None:
    keepalives = Keepalives(INTERVAL_S)
    stream = new_stream()
    body = EventStreamBody(stream, NativeEvents("a", 4), keepalive_s=INTERVAL_S,
                           keepalives=keepalives)
    sent: list[tuple[float, bytes]] = []

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keepalives.run)
        await trio.sleep(1.0)  # the body starts 1 s after a tick
        nursery.start_soon(send_body, body, sent)
        await trio.sleep(20.0)
        nursery.cancel_scope.cancel()

    assert [t for t, chunk in sent if chunk == KEEPALIVE_COMMENT] == [18.75]
    assert 1.0 + INTERVAL_S <= 18.75 <= 1.0 + INTERVAL_S * 1.25


async def test_a_nudge_takes_nothing_and_a_plain_receive_ignores_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream = new_stream()
    stream.nudge()  # nobody waits: a no-op, not a stale nudge for the next wait
    got: list[object] = []

    async def plain_receive() -> None:
        got.append(await stream.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(plain_receive)
        await trio.sleep(1.0)
        stream.nudge()  # receive() is not a keep-alive wait: it goes on waiting
        await trio.sleep(1.0)
        assert got == []
        stream.deliver(token(0))
    assert got == [token(0)]

    async with trio.open_nursery() as nursery:
        async def batch() -> None:
            got.append(await stream.receive_batch(8))

        nursery.start_soon(batch)
        await trio.sleep(1.0)
        stream.nudge()
    assert got[-1] == []  # nudged with nothing queued: no items

    stream.deliver(token(1))
    stream.nudge()  # an item is queued: nothing waits, the batch returns it
    assert await stream.receive_batch(8) == [token(1)]


async def test_a_body_cancelled_while_it_waits_on_the_timer_closes_its_stream_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    keepalives = Keepalives(INTERVAL_S)
    owner = Owner()
    stream = new_stream(owner)
    body = EventStreamBody(stream, NativeEvents("a", 4), keepalive_s=INTERVAL_S,
                           keepalives=keepalives)
    sent: list[tuple[float, bytes]] = []

    async with trio.open_nursery() as nursery:
        nursery.start_soon(keepalives.run)
        with trio.move_on_after(20.0):  # the client's disconnect, after one keep-alive
            await send_body(body, sent)
        nursery.cancel_scope.cancel()

    assert [chunk == KEEPALIVE_COMMENT for _, chunk in sent] == [False, True]
    assert owner.calls == ["cancel", "unregister"]
    keepalives.tick(trio.current_time() + INTERVAL_S)  # nobody left to nudge
    assert keepalives.nudges == 1


def test_an_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        Keepalives(0.0)
