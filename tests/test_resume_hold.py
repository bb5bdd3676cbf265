"""``ResumeRegistry.adopt(hold_s=...)``: a background response runs past the grace period
with no reader, and its log is then kept for a grace period after its end, as any
other's (the scripted engine in virtual time, as ``test_resumption.py``)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from streams.resume import Holding, NothingToResume
from tests.fakes import STEP_S, ScriptedEngine, request
from tests.test_resume_registry import GRACE_S, encode, open_registry, read

HOLD_S = 4 * GRACE_S


async def test_a_held_stream_generates_past_the_grace_period_with_no_reader(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    tokens = int(3 * GRACE_S / STEP_S)  # ends at about 3 grace periods: within the hold
    async with open_registry(engine) as (hub, registry):
        stream = hub.open_stream(request("r", tokens))
        registry.adopt(stream, encode, b"1 start r\n", attach=False, hold_s=HOLD_S)
        created_at = trio.current_time()

        await trio.sleep_until(created_at + 2 * GRACE_S)
        assert engine.cancelled == [] and registry.holding("r") is Holding.DETACHED
        reader = await registry.attach("r", 0)
        events = await read(reader)
        ended_at = trio.current_time()
        reader.close()
        await trio.sleep_until(ended_at + GRACE_S)
        await trio.testing.wait_all_tasks_blocked()

        assert events[-1][1] == f"{tokens + 2} done\n".encode()  # every token, then done
        assert ended_at > created_at + 2 * GRACE_S
        assert registry.holding("r") is Holding.GONE  # its log: a grace period after
        assert engine.cancelled == []  # it ended by itself


async def test_a_held_stream_still_ends_at_its_hold(
    autojump_clock: trio.testing.MockClock,
) -> None:
    engine = ScriptedEngine()
    async with open_registry(engine) as (hub, registry):
        stream = hub.open_stream(request("r", 1000))
        registry.adopt(stream, encode, b"1 start r\n", attach=False, hold_s=HOLD_S)
        created_at = trio.current_time()

        await trio.sleep_until(created_at + HOLD_S - STEP_S)
        assert engine.cancelled == []
        await trio.sleep_until(created_at + HOLD_S)
        await trio.testing.wait_all_tasks_blocked()

        assert engine.cancelled == ["r"] and registry.statistics().expiries == 1
        with pytest.raises(NothingToResume):
            await registry.attach("r", 0)
