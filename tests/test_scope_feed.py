"""The scope's feed (``streams.scope_feed``) on a hub over the scripted engine, in virtual
time: nothing built without a watcher, a frame per routing, ends with their reasons, a
disconnect drawn from close to release, a bounded watcher that drops and counts, a slow
watcher dropped, a reconnect that replays or starts from a snapshot."""

from __future__ import annotations

import dataclasses
from typing import Any

import trio
import trio.testing

from engine import EngineStatistics
from streams import HubSettings, PolicyName, ScopeFeed, ScopeFrame, StreamError, TokenStream
from streams.policy import Policy
from streams.scope_feed import PENDING_STEPS
from tests.fakes import STEP_S, ScriptedEngine, open_hub, request


async def read_all(stream: TokenStream, tokens: int | None = None) -> None:
    """Read ``stream`` (``tokens`` of it, or to the end), then close it."""
    try:
        taken = 0
        async for _ in stream:
            taken += 1
            if tokens is not None and taken >= tokens:
                break
    finally:
        stream.close()


def frames_of(items: list[Any]) -> list[ScopeFrame]:
    return [i for i in items if isinstance(i, ScopeFrame)]


def last_row(frames: list[ScopeFrame], request_id: str) -> Any:
    rows = [r for f in frames for r in f.rows if r.request_id == request_id]
    return rows[-1]


async def test_nothing_is_built_without_a_watcher(autojump_clock: trio.testing.MockClock) -> None:
    def built(*args: object) -> None:
        raise AssertionError("the feed built something with no watcher")

    async with open_hub(ScriptedEngine()) as hub:
        hub.scope.stepped = built  # type: ignore[method-assign]
        hub.scope.routed = built  # type: ignore[method-assign]
        with hub.open_stream(request("a", 8)) as a:
            await read_all(a)
        assert hub.statistics().steps > 0
    assert hub.scope.frames_made == 0


async def test_a_watcher_sees_every_step_and_a_stream_end_with_its_reason(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(ScriptedEngine()) as hub:
        watcher = hub.scope.subscribe()
        [snapshot] = watcher.take_ready(1000)  # built as it is taken: nothing yet
        with hub.open_stream(request("a", 4)) as a:
            await read_all(a)
        await trio.sleep(STEP_S * 4)
        frames = frames_of(watcher.take_ready(1000))
        watcher.close()
    assert isinstance(snapshot, ScopeFrame) and snapshot.snapshot and snapshot.rows == ()
    assert not any(f.snapshot for f in frames)
    steps = [s.step for f in frames for s in f.steps]
    assert steps == list(range(1, hub.statistics().steps + 1))
    states = [r.state for f in frames for r in f.rows]
    assert states[0] in ("waiting", "prefilling", "running")
    assert "running" in states
    final = last_row(frames, "a")
    assert (final.state, final.tokens, final.released) == ("length", 4, True)
    assert not hub.scope.watched  # the last watcher left: the feed forgot everything


async def test_a_client_that_leaves_ends_cancelled_and_its_release_is_a_disconnect(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_hub(engine) as hub:
        watcher = hub.scope.subscribe()
        stream = hub.open_stream(request("a", 1000))
        await read_all(stream, tokens=3)  # the client leaves: close() while generating
        await trio.sleep(STEP_S * 4)
        frames = frames_of(watcher.take_ready(1000))
        watcher.close()
    rows = [r for f in frames for r in f.rows if r.request_id == "a" and r.is_over]
    assert [r.state for r in rows] == ["cancelled"] * len(rows)
    assert rows[-1].released and rows[-1].tokens >= 3
    [moment] = [m for f in frames for m in f.moments if m.kind == "disconnect"]
    assert moment.request_id == "a"
    assert moment.steps == 1  # the next step applied the cancel and released the blocks
    assert moment.ms is not None and 0 < moment.ms <= STEP_S * 1000
    assert engine.releases["a"] == 1


async def test_a_full_watcher_drops_frames_counts_them_and_catches_up_with_a_snapshot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = HubSettings(policy=PolicyName.PAUSE, queue_limit=4)
    async with open_hub(ScriptedEngine(), settings) as hub:
        watcher = hub.scope.subscribe()
        watcher.take_ready(1)  # the first snapshot
        with hub.open_stream(request("a", 20)) as a:
            await read_all(a)
        assert watcher.queued == 4  # bounded
        assert watcher.missed > 0
        missed = watcher.missed
        items = watcher.take_ready(100)
        watcher.close()
    assert isinstance(items[0], ScopeFrame) and items[0].snapshot
    assert items[0].missed == missed
    assert [r.state for r in items[0].rows if r.request_id == "a"] == ["length"]


async def test_a_watcher_behind_past_the_stall_timeout_is_dropped_as_a_slow_client(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = HubSettings(policy=PolicyName.PAUSE_DROP, queue_limit=2, stall_timeout_s=0.25)
    async with open_hub(ScriptedEngine(), settings) as hub:
        watcher = hub.scope.subscribe()
        with hub.open_stream(request("a", 64)) as a:  # 64 steps: a second of virtual time
            await read_all(a)
        items = watcher.take_ready(10)
        assert hub.scope.watchers == 0 and not hub.scope.watched
    assert len(items) == 1 and isinstance(items[0], StreamError)
    assert items[0].type.value == "slow_client"


async def test_a_slow_reader_shows_paused_then_dropped_with_who_paid(
    autojump_clock: trio.testing.MockClock,
) -> None:
    settings = HubSettings(policy=PolicyName.PAUSE_DROP, queue_limit=4, stall_timeout_s=0.5)
    seen: list[ScopeFrame] = []

    async def watch(hub: Any) -> None:
        watcher = hub.scope.subscribe()
        try:
            while True:
                seen.extend(frames_of(await watcher.receive_batch(100)))
        finally:
            watcher.close()

    async with open_hub(ScriptedEngine(), settings) as hub, trio.open_nursery() as nursery:
        nursery.start_soon(watch, hub)
        with hub.open_stream(request("slow", 1000)) as slow:
            await trio.sleep(1.0)  # never read: paused at 4 queued, dropped 0.5 s later
            assert isinstance(await slow.receive(), StreamError)
        await trio.sleep(STEP_S * 4)
        nursery.cancel_scope.cancel()
    kinds = [m.kind for f in seen for m in f.moments if m.request_id == "slow"]
    assert kinds == ["pause", "drop"]
    states = [r.state for f in seen for r in f.rows if r.request_id == "slow"]
    assert "paused" in states and states[-1] == "dropped"
    assert last_row(seen, "slow").released


async def test_a_reconnect_replays_what_it_missed_or_starts_from_a_snapshot(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_hub(ScriptedEngine()) as hub:
        keeper = hub.scope.subscribe()  # someone else watches on: frames go on being made
        first = hub.scope.subscribe()
        with hub.open_stream(request("a", 6)) as a:
            await read_all(a, tokens=2)
            seen = frames_of(first.take_ready(100))
            first.close()
            last_id = seen[-1].event_id
            await trio.sleep(STEP_S * 3)
            again = hub.scope.subscribe(last_id)
            stranger = hub.scope.subscribe("another-life-7")
            replayed = frames_of(again.take_ready(100))
            fresh = stranger.take_ready(100)
        for watcher in (keeper, again, stranger):
            watcher.close()
    assert replayed and not replayed[0].snapshot
    ids = [int(f.event_id.rpartition("-")[2]) for f in replayed]
    assert ids == list(range(int(last_id.rpartition("-")[2]) + 1, ids[-1] + 1))
    assert isinstance(fresh[0], ScopeFrame) and fresh[0].snapshot


class NoStreams:
    def get(self, request_id: str) -> TokenStream | None:
        return None

    def all(self) -> list[TokenStream]:
        return []


class NoSteps:
    steps = 0


def engine_stats(step: int, **fields: Any) -> EngineStatistics:
    base = EngineStatistics(blocks_total=8, blocks_free=8, blocks_reserved=0, running=0,
                            waiting=0, paused=0, admitted=0, releases=0, steps=step,
                            last_step_ms=2.0, median_decode_step_ms=None)
    return dataclasses.replace(base, **fields)


async def test_a_preemption_for_a_higher_band_is_a_moment_of_its_own(
    autojump_clock: trio.testing.MockClock,
) -> None:
    feed = ScopeFeed(Policy(PolicyName.PAUSE_DROP), streams=NoStreams(), stepping=NoSteps())
    watcher = feed.subscribe()
    watcher.take_ready(1)  # its snapshot
    feed.stepped(engine_stats(1))
    feed.stepped(engine_stats(2, preemptions=1, priority_preemptions=1))
    feed.routed([])
    (frame,) = watcher.take_ready(10)
    watcher.close()
    assert isinstance(frame, ScopeFrame)
    assert [(m.kind, m.count) for m in frame.moments] == [("preemption", 1), ("priority", 1)]


async def test_a_preemption_and_its_recompute_are_moments_and_pending_steps_are_bounded(
    autojump_clock: trio.testing.MockClock,
) -> None:
    feed = ScopeFeed(Policy(PolicyName.PAUSE_DROP), streams=NoStreams(), stepping=NoSteps())
    watcher = feed.subscribe()
    watcher.take_ready(1)  # its snapshot
    feed.stepped(engine_stats(1))
    feed.stepped(engine_stats(2, preemptions=1, recomputed_tokens=0, blocks_shared=3))
    feed.stepped(engine_stats(3, preemptions=1, recomputed_tokens=48))
    feed.routed([])
    for step in range(4, 4 + PENDING_STEPS + 10):
        feed.stepped(engine_stats(step))
    feed.routed([])
    first, second = watcher.take_ready(10)
    watcher.close()
    assert isinstance(first, ScopeFrame) and isinstance(second, ScopeFrame)
    assert [(m.kind, m.count) for m in first.moments] == [("preemption", 1), ("recompute", 48)]
    assert [s.step for s in first.steps] == [1, 2, 3]
    assert len(second.steps) == PENDING_STEPS and feed.steps_lost == 10
    assert first.pool is not None and first.pool.total == 8
