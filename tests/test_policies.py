"""Slow-reader policies: the pure decisions, then one slow reader among eight."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import trio
import trio.testing

from engine import FinishEvent, FinishReason, TokenEvent
from streams import Hub, HubSettings, PolicyName, RunStep, StreamEnd, StreamError, TokenStream
from streams.policy import CAUGHT_UP, Lag, Policy
from tests.fakes import STEP_S, ScriptedEngine, open_hub, request

TOKENS = 16
SLOW_READ_S = 8.5 * STEP_S  # a slow reader takes one item, then sleeps this long
LIMIT = 4
STALL_S = 4.5 * STEP_S  # half a step off the step grid: no ties with step ends


# -- the decisions -----------------------------------------------------------------


def test_policy_rejects_out_of_range_limits() -> None:
    with pytest.raises(ValueError, match="queue_limit"):
        Policy(PolicyName.PAUSE, queue_limit=0)
    with pytest.raises(ValueError, match="stall_timeout_s"):
        Policy(PolicyName.DROP, stall_timeout_s=0.0)


def test_unbounded_never_pauses_or_starts_a_stall() -> None:
    policy = Policy(PolicyName.UNBOUNDED, queue_limit=LIMIT)
    assert policy.after_put(CAUGHT_UP, 1000, now=5.0) == CAUGHT_UP


def test_pause_pauses_at_the_limit_and_not_before() -> None:
    policy = Policy(PolicyName.PAUSE, queue_limit=LIMIT)
    assert policy.after_put(CAUGHT_UP, LIMIT - 1, now=0.0) == CAUGHT_UP
    assert policy.after_put(CAUGHT_UP, LIMIT, now=0.0) == Lag(is_paused=True)


def test_drop_starts_the_stall_clock_once() -> None:
    policy = Policy(PolicyName.DROP, queue_limit=LIMIT, stall_timeout_s=2.0)
    lag = policy.after_put(CAUGHT_UP, LIMIT, now=1.0)
    assert lag == Lag(stall_deadline=3.0)
    assert policy.after_put(lag, LIMIT + 1, now=2.5) == lag
    assert not policy.is_overdue(lag, now=2.9)
    assert policy.is_overdue(lag, now=3.0)


def test_pause_drop_pauses_and_starts_the_stall_clock() -> None:
    policy = Policy(PolicyName.PAUSE_DROP, queue_limit=LIMIT, stall_timeout_s=2.0)
    assert policy.after_put(CAUGHT_UP, LIMIT, now=1.0) == Lag(is_paused=True, stall_deadline=3.0)


def test_catching_up_to_low_water_resumes_and_stops_the_clock() -> None:
    policy = Policy(PolicyName.PAUSE_DROP, queue_limit=LIMIT, stall_timeout_s=2.0)
    behind = Lag(is_paused=True, stall_deadline=3.0)
    assert policy.low_water == LIMIT // 2
    assert policy.after_take(behind, policy.low_water + 1) == behind
    assert policy.after_take(behind, policy.low_water) == CAUGHT_UP


# -- one slow reader among eight ------------------------------------------------------


async def read_all(stream: TokenStream, pause_s: float, done: dict[str, float]) -> None:
    with stream:
        async for _ in stream:
            if pause_s:
                await trio.sleep(pause_s)
        done[stream.request_id] = trio.current_time()


async def healthy_durations(
    policy: PolicyName, *, slow_readers: int,
    run_step: Callable[[Callable[[], Hub | None]], RunStep] | None = None,
    stream_type: type[TokenStream] | None = None,
) -> list[float]:
    """How long each of the 8 - slow_readers healthy streams took, from opening."""
    settings = HubSettings(policy=policy, queue_limit=LIMIT, stall_timeout_s=STALL_S)
    done: dict[str, float] = {}
    start = trio.current_time()
    engine = ScriptedEngine(batch_limit=8)
    opened: list[Hub] = []
    stepping = None if run_step is None else run_step(lambda: opened[0] if opened else None)
    async with (open_hub(engine, settings, run_step=stepping, stream_type=stream_type) as hub,
                trio.open_nursery() as readers):
        opened.append(hub)
        for i in range(8):
            stream = hub.open_stream(request(f"r{i}", TOKENS))
            readers.start_soon(read_all, stream, SLOW_READ_S if i < slow_readers else 0, done)
    return [done[f"r{i}"] - start for i in range(slow_readers, 8)]


@pytest.mark.parametrize(
    "policy", [PolicyName.UNBOUNDED, PolicyName.PAUSE, PolicyName.DROP, PolicyName.PAUSE_DROP]
)
async def test_one_slow_reader_does_not_delay_the_other_seven(
    policy: PolicyName, autojump_clock: trio.testing.MockClock
) -> None:
    # One prefill step, then TOKENS - 1 decode steps.
    assert await healthy_durations(policy, slow_readers=0) == [TOKENS * STEP_S] * 8
    assert await healthy_durations(policy, slow_readers=1) == [TOKENS * STEP_S] * 7


# -- what each policy does to the slow stream --------------------------------------------


async def test_drop_sends_slow_client_and_cancels_the_sequence_once(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    settings = HubSettings(policy=PolicyName.DROP, queue_limit=LIMIT, stall_timeout_s=STALL_S)
    async with open_hub(engine, settings) as hub:
        with hub.open_stream(request("slow", 64)) as stream:
            await trio.sleep(1.0)  # a reader that does not read
            item = await stream.receive()
            assert isinstance(item, StreamError)
            assert item.type == "slow_client"
            with pytest.raises(trio.EndOfChannel):
                await stream.receive()
            stats = stream.statistics()
    # Behind from step 4; dropped at 4 + 4.5 steps; the cancel applied at step 9.
    # Steps 5 to 8 added four tokens: the discarded backlog is 8 tokens.
    assert (stats.end, stats.discarded) == (StreamEnd.ERROR, 8)
    assert engine.cancelled == ["slow"]
    assert engine.log == [(9, "cancel", "slow")]
    assert hub.statistics().slow_client_drops == 1


async def test_pause_holds_the_slot_and_resumes_when_the_reader_catches_up(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    settings = HubSettings(policy=PolicyName.PAUSE, queue_limit=LIMIT, stall_timeout_s=STALL_S)
    async with open_hub(engine, settings) as hub:
        with hub.open_stream(request("slow", TOKENS)) as stream:
            await trio.sleep(1.0)
            assert engine.is_paused("slow")
            assert engine.blocks_held("slow") > 0
            assert hub.statistics().paused_streams == 1
            assert stream.statistics().queued == LIMIT
            items = [item async for item in stream]
    assert items[:-1] == [TokenEvent("slow", i, i, f" t{i}") for i in range(TOKENS)]
    assert items[-1] == FinishEvent("slow", FinishReason.LENGTH, 3, TOKENS)
    # Paused at step 5 (queue full after step 4); resumed once the reader took two.
    assert engine.log[:2] == [(5, "pause", "slow"), (6, "resume", "slow")]
    assert engine.cancelled == []


async def test_pause_drop_pauses_then_drops_after_the_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    settings = HubSettings(policy=PolicyName.PAUSE_DROP, queue_limit=LIMIT, stall_timeout_s=STALL_S)
    async with open_hub(engine, settings) as hub:
        with hub.open_stream(request("slow", 64)) as stream:
            await trio.sleep_until(8.25 * STEP_S)
            assert stream.statistics().end is None
            assert engine.is_paused("slow")
            await trio.sleep_until(8.75 * STEP_S)  # the deadline was 4 + 4.5 steps
            assert stream.statistics().end is StreamEnd.ERROR
            item = await stream.receive()
            assert isinstance(item, StreamError)
            assert item.type == "slow_client"
    # The loop slept while the only sequence was paused: the drop woke it.
    assert engine.log == [(5, "pause", "slow"), (6, "cancel", "slow")]
    assert engine.cancelled == ["slow"]
    assert stream.statistics().discarded == LIMIT
