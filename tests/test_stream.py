"""TokenStream: receive is cancel-safe, close is one idempotent non-checkpoint on every exit."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from engine import FinishEvent, FinishReason, TokenEvent
from streams import HubSettings, PolicyName, StreamEnd, StreamError, StreamState, TokenStream
from streams.policy import Policy
from tests.fakes import STEP_S, ScriptedEngine, open_hub, request


async def test_items_are_tokens_in_order_then_finish_then_end_of_channel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(ScriptedEngine()) as hub:
        with hub.open_stream(request("a", 3)) as stream:
            items = [await stream.receive() for _ in range(4)]
            with pytest.raises(trio.EndOfChannel):
                await stream.receive()
    assert items == [
        TokenEvent("a", 0, 0, " t0"),
        TokenEvent("a", 1, 1, " t1"),
        TokenEvent("a", 2, 2, " t2"),
        FinishEvent("a", FinishReason.LENGTH, 3, 3),
    ]


async def test_receive_cancelled_at_its_checkpoint_takes_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(ScriptedEngine()) as hub:
        with hub.open_stream(request("a", 1)) as stream:
            await trio.sleep(1.5 * STEP_S)  # step 1 queued a token and the finish
            with trio.CancelScope() as scope:
                scope.cancel(reason="test: cancel before receive")
                await stream.receive()
            assert scope.cancelled_caught
            assert stream.statistics().queued == 2
            assert await stream.receive() == TokenEvent("a", 0, 0, " t0")


async def test_receive_under_move_on_after_loses_no_item(
    autojump_clock: trio.testing.MockClock,
) -> None:
    items: list[object] = []
    timeouts = 0
    async with open_hub(ScriptedEngine()) as hub:
        with hub.open_stream(request("a", 8)) as stream:
            while not items or not isinstance(items[-1], FinishEvent):
                with trio.move_on_after(STEP_S / 3) as scope:
                    items.append(await stream.receive())
                timeouts += scope.cancelled_caught
    assert timeouts >= 8  # two in each step's wait, at least
    assert items[:-1] == [TokenEvent("a", i, i, f" t{i}") for i in range(8)]


async def test_close_after_finishing_is_idempotent_never_a_checkpoint_and_cancels_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_hub(engine) as hub:
        stream = hub.open_stream(request("a", 2))
        assert [type(item) async for item in stream] == [TokenEvent, TokenEvent, FinishEvent]
        with trio.testing.assert_no_checkpoints():
            stream.close()
            stream.close()
        assert hub.statistics().closes == 1
        with pytest.raises(trio.ClosedResourceError):
            await stream.receive()
    assert stream.statistics().end is StreamEnd.FINISHED
    assert engine.cancelled == []


async def test_client_gone_mid_receive_closes_once_and_cancels_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_hub(engine) as hub:
        stream = hub.open_stream(request("a", 64))

        async def reader(scope: trio.CancelScope) -> None:
            with scope:
                try:
                    async for _ in stream:
                        pass
                finally:
                    with trio.testing.assert_no_checkpoints():
                        stream.close()

        scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader, scope)
            await trio.sleep(3.5 * STEP_S)
            scope.cancel(reason="test: client disconnected")
        assert scope.cancelled_caught
        stream.close()
        assert hub.statistics().closes == 1
    assert stream.statistics().end is StreamEnd.CLIENT_GONE
    assert engine.cancelled == ["a"]
    assert engine.releases["a"] == 1


async def test_close_inside_a_cancelled_scope_still_cancels_in_the_engine(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_hub(engine) as hub:
        stream = hub.open_stream(request("a", 64))
        await trio.sleep(2.5 * STEP_S)
        with trio.CancelScope() as scope:
            scope.cancel(reason="test: already cancelled")
            with trio.testing.assert_no_checkpoints():
                stream.close()
            await trio.lowlevel.checkpoint()  # only here is the cancellation delivered
        assert scope.cancelled_caught
    assert engine.cancelled == ["a"]


async def test_close_after_an_error_item_closes_once_without_a_second_cancel(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    settings = HubSettings(policy=PolicyName.DROP, queue_limit=2, stall_timeout_s=STEP_S)
    async with open_hub(engine, settings) as hub:
        with hub.open_stream(request("a", 64)) as stream:
            await trio.sleep(1.0)
            assert isinstance(await stream.receive(), StreamError)
            with trio.testing.assert_no_checkpoints():
                stream.close()
        assert hub.statistics().closes == 1
    assert engine.releases["a"] == 1
    assert engine.cancelled == ["a"]


async def test_close_wakes_a_waiting_reader_with_closed_resource_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(ScriptedEngine()) as hub:
        stream = hub.open_stream(request("a"))

        async def reader() -> None:
            with pytest.raises(trio.ClosedResourceError):
                await stream.receive()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await trio.testing.wait_all_tasks_blocked()
            stream.close()


async def test_aclose_closes_then_checkpoints(autojump_clock: trio.testing.MockClock) -> None:
    async with open_hub(ScriptedEngine()) as hub:
        stream = hub.open_stream(request("a"))
        with trio.testing.assert_checkpoints():
            await stream.aclose()
        assert stream.state is StreamState.CLOSED


async def test_stream_states_follow_the_engine(autojump_clock: trio.testing.MockClock) -> None:
    async with open_hub(ScriptedEngine()) as hub:
        with hub.open_stream(request("a", 2)) as stream:
            states = [stream.state]
            await trio.sleep(1.5 * STEP_S)  # after step 1
            states.append(stream.state)
            await trio.sleep(STEP_S)  # after step 2
            states.append(stream.state)
            assert len([item async for item in stream]) == 3
        states.append(stream.state)
    assert states == [
        StreamState.WAITING,
        StreamState.STREAMING,
        StreamState.ENDED,
        StreamState.CLOSED,
    ]


async def test_engine_failing_one_sequence_ends_its_stream_with_engine_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine(fail_requests=frozenset({"bad"}))
    async with open_hub(engine) as hub:
        with hub.open_stream(request("bad")) as bad, hub.open_stream(request("good", 2)) as good:
            assert [type(item) async for item in good] == [TokenEvent, TokenEvent, FinishEvent]
            items = [item async for item in bad]
            assert bad.statistics().end is StreamEnd.ERROR
    assert items[1:] == [StreamError("engine_error", "scripted sequence failure")]
    assert engine.cancelled == []  # the engine had already released it


def test_stream_alone_closes_through_its_owner() -> None:
    calls: list[tuple[str, str]] = []

    class Owner:
        def pause(self, request_id: str) -> None: ...
        def resume(self, request_id: str) -> None: ...
        def watch(self, deadline: float) -> None: ...
        def writing(self, stream: TokenStream) -> None: ...
        def written(self, stream: TokenStream) -> None: ...

        def cancel(self, request_id: str) -> None:
            calls.append(("cancel", request_id))

        def unregister(self, stream: TokenStream) -> None:
            calls.append(("unregister", stream.request_id))

    stream = TokenStream("a", 3, Policy(PolicyName.UNBOUNDED), Owner())
    stream.close()
    stream.close()
    assert calls == [("cancel", "a"), ("unregister", "a")]


class MarkRecorder:
    """A control that records the writing marks (and ignores the rest)."""

    def __init__(self) -> None:
        self.marks: list[str] = []

    def pause(self, request_id: str) -> None: ...
    def resume(self, request_id: str) -> None: ...
    def watch(self, deadline: float) -> None: ...
    def cancel(self, request_id: str) -> None: ...
    def unregister(self, stream: TokenStream) -> None: ...

    def writing(self, stream: TokenStream) -> None:
        self.marks.append("writing")

    def written(self, stream: TokenStream) -> None:
        self.marks.append("written")


async def test_a_blocked_writer_is_not_waited_for_until_it_comes_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    control = MarkRecorder()
    stream = TokenStream("a", 3, Policy(PolicyName.PAUSE_DROP), control)
    stream.deliver(TokenEvent("a", 0, 0, " t0"))
    assert stream.take_ready(8) == [TokenEvent("a", 0, 0, " t0")]
    assert control.marks == ["writing"]  # its write of t0 is under way
    with trio.testing.assert_no_checkpoints():
        stream.write_blocked()  # ... and waits for the client
    assert control.marks == ["writing", "written"]
    stream.deliver(TokenEvent("a", 1, 1, " t1"))  # queued meanwhile: still not waited for
    stream.deliver(TokenEvent("a", 2, 2, " t2"))
    assert control.marks == ["writing", "written"]
    # The write went out: the writer is back for what was queued, and is waited for again.
    assert len(stream.take_ready(8)) == 2
    assert control.marks == ["writing", "written", "writing"]
    stream.write_blocked()
    stream.close()  # no second "written": it was not waited for
    assert control.marks == ["writing", "written", "writing", "written"]
