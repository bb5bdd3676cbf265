"""The resumption registry and its event log, on the scripted engine in virtual time.

The scripted engine makes one token per step, and a step costs ``STEP_S`` of virtual
time, so "the stream kept generating while detached" and "it was cancelled exactly at
the grace deadline" are exact statements here.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from engine import FinishEvent, TokenEvent
from streams import Hub, StreamError, StreamItem
from streams.resume import (
    BadPosition,
    Holding,
    MemoryEventLog,
    NothingToResume,
    Reader,
    ResumeRegistry,
    TakenOver,
)
from tests.fakes import STEP_S, ScriptedEngine, open_hub, request

GRACE_S = 1.0  # 64 steps


def encode(n: int, item: StreamItem) -> bytes:
    match item:
        case TokenEvent():
            return f"{n} token {item.token_id}\n".encode()
        case FinishEvent():
            return f"{n} done\n".encode()
        case StreamError():
            return f"{n} error {item.type}\n".encode()
    raise TypeError(item)


@asynccontextmanager
async def open_registry(
    engine: ScriptedEngine, *, max_detached_bytes: int = 1 << 20
) -> AsyncIterator[tuple[Hub, ResumeRegistry]]:
    async with open_hub(engine) as hub, trio.open_nursery() as nursery:
        registry = ResumeRegistry(MemoryEventLog(), grace_s=GRACE_S,
                                  max_detached_bytes=max_detached_bytes)
        await nursery.start(registry.run)
        yield hub, registry
        nursery.cancel_scope.cancel(reason="the test is over")


def adopt(hub: Hub, registry: ResumeRegistry, request_id: str, max_new_tokens: int,
          *, attach: bool = True) -> Reader | None:
    stream = hub.open_stream(request(request_id, max_new_tokens))
    return registry.adopt(stream, encode, f"1 start {request_id}\n".encode(), attach=attach)


async def read(reader: Reader, count: int | None = None) -> list[tuple[int, bytes]]:
    """(n, bytes) of ``count`` events, or of every event to the end."""
    got = []
    while count is None or len(got) < count:
        try:
            event = await reader.receive()
        except trio.EndOfChannel:
            break
        got.append((event.n, event.data))
    return got


async def test_reader_close_hands_the_stream_over_without_a_checkpoint(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_registry(engine) as (hub, registry):
        reader = adopt(hub, registry, "r", 1000)
        assert reader is not None
        await read(reader, 3)

        with trio.testing.assert_no_checkpoints():
            reader.close()
            reader.close()

        assert registry.holding("r") is Holding.DETACHED
        assert registry.cancel("r")


async def test_detached_stream_generates_until_the_grace_deadline_then_is_cancelled(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_registry(engine) as (hub, registry):
        reader = adopt(hub, registry, "r", 1000)
        assert reader is not None
        await read(reader, 3)
        reader.close()
        detached_at = trio.current_time()

        await trio.sleep_until(detached_at + GRACE_S - STEP_S)
        assert engine.cancelled == []
        assert registry.holding("r") is Holding.DETACHED
        tokens_then = hub.statistics().events_routed

        await trio.sleep_until(detached_at + GRACE_S)
        await trio.testing.wait_all_tasks_blocked()

        assert engine.cancelled == ["r"]
        assert registry.holding("r") is Holding.GONE
        assert tokens_then > 3 + GRACE_S / STEP_S / 2  # it went on generating
        assert registry.statistics().expiries == 1
        with pytest.raises(NothingToResume):
            await registry.attach("r", 0)
    assert engine.releases["r"] == 1


async def test_attach_within_the_grace_takes_over_with_no_gap_or_duplicate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_registry(engine) as (hub, registry):
        reader = adopt(hub, registry, "r", 100)
        assert reader is not None
        first = await read(reader, 4)
        reader.close()
        await trio.sleep(GRACE_S / 2)

        second = await registry.attach("r", 4)
        rest = await read(second)
        second.close()

        events = first + rest
        assert [n for n, _ in events] == list(range(1, 103))
        assert [data for _, data in events[1:-1]] == [
            f"{n} token {n - 2}\n".encode() for n in range(2, 102)]
        assert engine.cancelled == []
        assert registry.statistics().resumes == 1
        assert registry.cancel("r")


async def test_a_second_reader_takes_over_and_the_first_gets_no_more(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_registry(engine) as (hub, registry):
        reader = adopt(hub, registry, "r", 100)
        assert reader is not None
        first = await read(reader, 3)
        after_takeover: list[int] = []
        taken_over = trio.Event()

        async def first_reads_on() -> None:  # it waits in a take when the second comes
            with pytest.raises(TakenOver):
                while True:
                    event = await reader.receive()
                    if taken_over.is_set():
                        after_takeover.append(event.n)
            taken_over.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(first_reads_on)
            await trio.sleep(10 * STEP_S)
            with pytest.raises(BadPosition):
                await registry.attach("r", 500)
            second = await registry.attach("r", 3)
            taken_over.set()
            rest = await read(second)
        with pytest.raises(TakenOver):
            await reader.receive()
        reader.close()  # the first's connection ends: the second keeps the stream
        assert registry.holding("r") is Holding.ATTACHED
        second.close()

        assert after_takeover == []
        events = first + rest
        assert [n for n, _ in events] == list(range(1, 103))
        assert [data for _, data in events[1:-1]] == [
            f"{n} token {n - 2}\n".encode() for n in range(2, 102)]
        assert engine.cancelled == []
        assert registry.statistics().resumes == 1
        assert registry.cancel("r")


async def test_detached_stream_past_the_byte_cap_ends_with_resume_log_full(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_registry(engine, max_detached_bytes=200) as (hub, registry):
        adopt(hub, registry, "r", 1000, attach=False)
        await trio.sleep(GRACE_S / 2)

        assert engine.cancelled == ["r"]
        stats = registry.statistics()
        assert stats.overflows == 1
        reader = await registry.attach("r", 0)
        events = await read(reader)
        assert events[-1][1].endswith(b"error resume_log_full\n")
        assert sum(len(data) for _, data in events[:-1]) <= 200
        assert registry.cancel("r")


async def test_a_finished_log_is_kept_until_the_deadline_then_expired(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_registry(engine) as (hub, registry):
        adopt(hub, registry, "r", 5, attach=False)
        created_at = trio.current_time()
        await trio.sleep(GRACE_S / 2)
        assert hub.statistics().streams_open == 0  # the stream closed at its end

        reader = await registry.attach("r", 3)
        assert [n for n, _ in await read(reader)] == [4, 5, 6, 7]
        reader.close()
        closed_at = trio.current_time()
        with pytest.raises(NothingToResume):
            await registry.attach("r", 7)  # ended, and this reader has every event
        await trio.sleep_until(closed_at + GRACE_S)
        await trio.testing.wait_all_tasks_blocked()

        assert closed_at > created_at
        assert registry.holding("r") is Holding.GONE
        assert registry.statistics().log_bytes == 0
        assert engine.cancelled == []


def test_memory_log_numbers_events_without_gaps() -> None:
    log = MemoryEventLog()
    log.append("a", 1, b"one")
    log.append("a", 2, b"two")

    with pytest.raises(ValueError, match="follows 2"):
        log.append("a", 4, b"four")
    assert log.read_after("a", 1) == [b"two"]
    assert log.read_after("b", 0) is None
    assert log.expire("a") == 6
    assert log.expire("a") == 0
    assert log.total_bytes == 0
