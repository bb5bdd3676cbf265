"""The hub: refusals before anything opens, the step loop, first tokens, shutdown, failure."""

from __future__ import annotations

import threading

import pytest
import trio
import trio.testing

from engine import EmptyPrompt, FinishEvent, FinishReason, InvalidRequest, TokenEvent
from streams import (
    Hub,
    HubSettings,
    HubState,
    NotAccepting,
    StreamError,
    TokenStream,
    WaitingLimitReached,
)
from tests.fakes import (
    STEP_S,
    ScriptedEngine,
    ScriptedFailure,
    assert_settled,
    fixed_cost_step,
    open_hub,
    request,
)


async def drain(stream: TokenStream, into: list[object]) -> None:
    """Read ``stream`` to its end into ``into``, then close it as the app does."""
    try:
        async for item in stream:
            into.append(item)
    finally:
        with trio.testing.assert_no_checkpoints():
            stream.close()


# -- refusals ------------------------------------------------------------------------


async def test_open_stream_refuses_before_run_and_after_shutdown() -> None:
    hub = Hub(ScriptedEngine())
    with pytest.raises(NotAccepting, match="new"):
        hub.open_stream(request("a"))
    await hub.shutdown()
    with pytest.raises(NotAccepting, match="stopped"):
        hub.open_stream(request("a"))


async def test_invalid_request_is_refused_and_nothing_registers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_hub(engine) as hub:
        with pytest.raises(EmptyPrompt):
            hub.open_stream(request("a", prompt=""))
        assert (hub.statistics().streams_open, hub.statistics().opened) == (0, 0)
    assert engine.submitted == []


async def test_an_id_in_use_is_refused(autojump_clock: trio.testing.MockClock) -> None:
    async with open_hub(ScriptedEngine()) as hub:
        with hub.open_stream(request("a")), pytest.raises(InvalidRequest, match="in use"):
            hub.open_stream(request("a"))


async def test_waiting_limit_refuses_until_a_first_token_arrives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    settings = HubSettings(max_waiting=2, waiting_retry_after_s=0.5)
    async with open_hub(engine, settings) as hub:
        with hub.open_stream(request("a", 1)) as a, hub.open_stream(request("b", 1)) as b:
            with pytest.raises(WaitingLimitReached) as refused:
                hub.open_stream(request("c", 1))
            assert refused.value.retry_after_s == 0.5
            assert engine.submitted == ["a", "b"]
            await trio.sleep(1.5 * STEP_S)  # a and b got their first tokens at step 1
            with hub.open_stream(request("c", 1)) as c:
                for stream in (a, b, c):
                    assert [type(item) async for item in stream] == [TokenEvent, FinishEvent]
        assert hub.statistics().refused_waiting == 1


# -- the step loop -------------------------------------------------------------------


async def test_step_loop_sleeps_without_work_and_open_stream_wakes_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_hub(engine) as hub:
        await trio.sleep(10.0)
        assert engine.steps == 0
        start = trio.current_time()
        with hub.open_stream(request("a", 1)) as stream:
            assert isinstance(await stream.receive(), TokenEvent)
            assert trio.current_time() - start == STEP_S
            assert isinstance(await stream.receive(), FinishEvent)
        await trio.sleep(10.0)
    assert engine.steps == 1


async def test_full_batch_of_paused_streams_does_not_spin(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # "a" is paused and holds the only slot; "b" waits and cannot be admitted, so the
    # engine reports work that no step can do.
    engine = ScriptedEngine(batch_limit=1)
    settings = HubSettings(queue_limit=2, stall_timeout_s=100.0)
    async with open_hub(engine, settings) as hub:
        with hub.open_stream(request("a", 64)) as a, hub.open_stream(request("b", 1)) as b:
            await trio.sleep(1.0)
            steps_before = engine.steps
            await trio.sleep(1.0)
            assert engine.steps - steps_before <= 1.0 / 0.01 + 1  # EMPTY_STEP_BACKOFF_S
            a.close()
            assert [type(item) async for item in b] == [TokenEvent, FinishEvent]


async def test_events_for_a_closed_stream_are_dropped_and_counted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_hub(engine) as hub:
        with hub.open_stream(request("a", 64)) as stream:
            await stream.receive()
        await trio.sleep(1.5 * STEP_S)  # step 2 applies the cancel: FinishEvent CANCELLED
        assert hub.statistics().events_dropped == 1
    assert engine.log == [(2, "cancel", "a")]
    assert engine.releases["a"] == 1


async def test_stream_closed_while_waiting_is_never_admitted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine(batch_limit=1)
    items: list[object] = []
    async with open_hub(engine) as hub, trio.open_nursery() as nursery:
        nursery.start_soon(drain, hub.open_stream(request("a", 8)), items)
        waiting = hub.open_stream(request("b", 8))
        await trio.sleep(3.5 * STEP_S)
        waiting.close()
    assert engine.admitted == ["a"]
    assert engine.cancelled == ["b"]
    assert "b" not in engine.releases
    assert isinstance(items[-1], FinishEvent)


# -- first tokens --------------------------------------------------------------------


async def test_first_token_is_queued_as_soon_as_its_own_prefill_is_done(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Before each prefill, every stream prefilled earlier in the same step already
    # holds its first token: delivery does not wait for the step's end.
    streams: dict[str, TokenStream] = {}
    seen: list[list[int]] = []

    def before_prefill(request_id: str) -> None:
        seen.append([s.statistics().queued for s in streams.values()])

    engine = ScriptedEngine(before_prefill=before_prefill)
    async with open_hub(engine) as hub:
        for name in "abc":
            streams[name] = hub.open_stream(request(name, 1))
        await trio.sleep(1.5 * STEP_S)
        for stream in streams.values():
            stream.close()
    assert seen == [[0, 0, 0], [2, 0, 0], [2, 2, 0]]  # a token and a finish each


async def test_first_token_reaches_its_reader_while_the_step_thread_still_runs() -> None:
    # With the default run_step, prefill events hop from the worker thread into Trio.
    # "b"'s prefill blocks the step until "a"'s reader got its first token: were it
    # delivered only at the step's end, the gate would time out.
    a_read = threading.Event()
    gate_opened: list[bool] = []

    def before_prefill(request_id: str) -> None:
        if request_id == "b":
            gate_opened.append(a_read.wait(timeout=10.0))

    engine = ScriptedEngine(before_prefill=before_prefill)
    async with open_hub(engine, run_step=trio.to_thread.run_sync) as hub:
        with hub.open_stream(request("a", 1)) as a, hub.open_stream(request("b", 1)) as b:
            assert isinstance(await a.receive(), TokenEvent)
            a_read.set()
            assert [type(item) async for item in b] == [TokenEvent, FinishEvent]
    assert gate_opened == [True]


# -- shutdown and failure ------------------------------------------------------------


async def test_shutdown_lets_streams_finish_within_grace_then_ends_the_rest(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    grace_s = 0.5 + STEP_S / 2  # ends mid-step: the step in flight applies the cancel
    hub = Hub(engine, HubSettings(shutdown_grace_s=grace_s), run_step=fixed_cost_step())
    short: list[object] = []
    long: list[object] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.run)
        nursery.start_soon(drain, hub.open_stream(request("short", 8)), short)
        nursery.start_soon(drain, hub.open_stream(request("long", 1000)), long)
        await trio.sleep(0.25 + STEP_S / 4)
        await hub.shutdown()
        assert trio.current_time() == 0.25 + 0.5 + STEP_S
    assert short[-1] == FinishEvent("short", FinishReason.LENGTH, 3, 8)
    assert long[-1] == StreamError("shutdown", "the server is shutting down")
    assert (hub.statistics().state, hub.statistics().closes) == (HubState.STOPPED, 2)
    assert engine.cancelled == ["long"]
    assert_settled(engine, hub)


async def test_shutdown_without_open_streams_returns_at_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(ScriptedEngine()) as hub:
        pass
    assert trio.current_time() == 0.0
    assert hub.statistics().state is HubState.STOPPED


async def test_step_failure_ends_streams_with_engine_error_and_is_raised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    hub = Hub(ScriptedEngine(fail_at_step=3), run_step=fixed_cost_step())
    items: list[object] = []
    with pytest.RaisesGroup(pytest.RaisesExc(ScriptedFailure, match="step 3")):
        async with trio.open_nursery() as nursery:
            await nursery.start(hub.run)
            nursery.start_soon(drain, hub.open_stream(request("a", 64)), items)
    assert [type(item) for item in items] == [TokenEvent, TokenEvent, StreamError]
    assert isinstance(items[-1], StreamError)
    assert items[-1].type == "engine_error"
    stats = hub.statistics()
    assert (stats.state, stats.step_errors, stats.closes) == (HubState.FAILED, 1, 1)
    assert stats.last_error is not None
    with pytest.raises(NotAccepting, match="failed"):
        hub.open_stream(request("b"))


async def test_cancelling_run_ends_open_streams_with_shutdown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    hub = Hub(engine, run_step=fixed_cost_step())
    items: list[object] = []
    async with trio.open_nursery() as readers, trio.open_nursery() as nursery:
        await nursery.start(hub.run)
        readers.start_soon(drain, hub.open_stream(request("a", 64)), items)
        await trio.sleep(2.5 * STEP_S)
        nursery.cancel_scope.cancel(reason="test: the hub's nursery is cancelled")
    assert items[-1] == StreamError("shutdown", "the hub stopped")
    assert hub.statistics().state is HubState.STOPPED
    # Nobody steps the engine any more: the cancel was asked for, never applied.
    assert (engine.cancelled, engine.log) == (["a"], [])


async def test_run_twice_is_refused(autojump_clock: trio.testing.MockClock) -> None:
    async with open_hub(ScriptedEngine()) as hub:
        with pytest.raises(RuntimeError, match="runs once"):
            await hub.run()
