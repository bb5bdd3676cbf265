"""The SSE body (``app/routes/body.py``) in-process, on a scripted stream and virtual clock.

What Quart does with a body (``async with body: async for chunk in body: send``) is
reproduced by ``send_body``; the stream is a fake that yields what a test queues.
"""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from app.errors import ErrorType
from app.routes.body import EventStreamBody
from app.wire import KEEPALIVE_COMMENT, NativeEvents
from engine import FinishEvent, FinishReason, TokenEvent
from streams import SSEParser, StreamError, StreamItem

KEEPALIVE_S = 15.0


class ScriptedStream:
    """An ItemSource whose items a test sends; records close() calls."""

    request_id = "req-1"
    prompt_tokens = 4

    def __init__(self) -> None:
        self.send, self._receive = trio.open_memory_channel[StreamItem](100)
        self.closes = 0

    def take_ready(self, max_items: int) -> list[StreamItem]:
        items: list[StreamItem] = []
        while len(items) < max_items:
            try:
                items.append(self._receive.receive_nowait())
            except trio.WouldBlock:
                break
        return items

    async def receive_batch(self, max_items: int) -> list[StreamItem]:
        first = await self._receive.receive()
        return [first, *self.take_ready(max_items - 1)]

    def close(self) -> None:
        self.closes += 1


def native_body(stream: ScriptedStream) -> EventStreamBody[StreamItem]:
    """The body of ``/v1/stream``: the stream's native events."""
    return EventStreamBody(stream, NativeEvents(stream.request_id, stream.prompt_tokens),
                           keepalive_s=KEEPALIVE_S)


def token(index: int) -> TokenEvent:
    return TokenEvent("req-1", index, 100 + index, f"t{index}")


FINISH = FinishEvent("req-1", FinishReason.LENGTH, 4, 2)


async def send_body(body: EventStreamBody[StreamItem], sent: list[tuple[float, bytes]]) -> None:
    """What quart's ``_send_response`` does with a ResponseBody, with a timestamp."""
    async with body as chunks:
        async for chunk in chunks:
            sent.append((trio.current_time(), chunk))


async def test_events_are_numbered_from_one_and_end_after_done() -> None:
    stream = ScriptedStream()
    for item in (token(0), token(1), FINISH):
        stream.send.send_nowait(item)
    sent: list[tuple[float, bytes]] = []

    await send_body(native_body(stream), sent)

    events = SSEParser().feed(b"".join(chunk for _, chunk in sent))
    assert [(e.event, e.id) for e in events] == [
        ("start", "1"), ("token", "2"), ("token", "3"), ("done", "4")
    ]
    assert json.loads(events[0].data) == {"id": "req-1", "prompt_tokens": 4}
    assert json.loads(events[1].data) == {"index": 0, "id": 100, "text": "t0"}
    assert stream.closes == 1


async def test_keepalive_goes_out_after_exactly_keepalive_s_of_quiet(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream = ScriptedStream()
    sent: list[tuple[float, bytes]] = []

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_body, native_body(stream), sent)
        await trio.sleep(40.0)
        stream.send.send_nowait(token(0))
        await trio.sleep(1.0)
        stream.send.send_nowait(FINISH)

    assert [(t, chunk == KEEPALIVE_COMMENT) for t, chunk in sent] == [
        (0.0, False), (15.0, True), (30.0, True), (40.0, False), (41.0, False)
    ]


async def test_stream_error_is_an_error_event_and_the_last_one() -> None:
    stream = ScriptedStream()
    stream.send.send_nowait(StreamError("slow_client", "too slow"))
    stream.send.send_nowait(token(5))  # never read: the error ended the body
    sent: list[tuple[float, bytes]] = []

    await send_body(native_body(stream), sent)

    events = SSEParser().feed(b"".join(chunk for _, chunk in sent))
    assert [e.event for e in events] == ["start", "error"]
    assert json.loads(events[1].data) == {"error": {"type": "slow_client", "message": "too slow"}}


async def test_cancelled_body_closes_its_stream_without_a_checkpoint(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stream = ScriptedStream()
    sent: list[tuple[float, bytes]] = []

    with trio.move_on_after(5.0) as scope:  # stands in for the client's disconnect
        await send_body(native_body(stream), sent)

    assert scope.cancelled_caught
    assert stream.closes == 1
    assert len(sent) == 1  # the start event only


async def test_body_closes_its_stream_when_a_send_raises() -> None:
    stream = ScriptedStream()
    body = native_body(stream)

    with pytest.raises(OSError, match="socket gone"):
        async with body as chunks:
            async for _ in chunks:
                raise OSError("socket gone")

    assert stream.closes == 1


async def test_exit_makes_no_checkpoint() -> None:
    body = native_body(ScriptedStream())
    await body.__aenter__()

    with trio.testing.assert_no_checkpoints():
        await body.__aexit__(None, None, None)


async def test_farewell_only_for_an_entered_unfinished_body() -> None:
    stream = ScriptedStream()
    body = native_body(stream)
    assert body.farewell(ErrorType.SHUTDOWN, "bye") is None  # never entered: no status yet

    await body.__aenter__()
    await body.__anext__()  # start, id 1
    last = body.farewell(ErrorType.SHUTDOWN, "bye")

    assert last is not None
    (event,) = SSEParser().feed(last)
    assert (event.event, event.id) == ("error", "2")
    assert body.farewell(ErrorType.SHUTDOWN, "bye") is None  # only once
    with pytest.raises(StopAsyncIteration):
        await body.__anext__()
