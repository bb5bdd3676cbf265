"""The lab's ``naive`` (``tools/lab/naive.py``): no policy of the service, installed in
the lab's server as the hub's ``run_step``; one slow reader then delays everyone."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from streams import Hub, HubSettings, PolicyName
from tests.fakes import STEP_S, ScriptedEngine, fixed_cost_step, open_hub, request
from tests.test_policies import SLOW_READ_S, TOKENS, healthy_durations, read_all
from tools.lab._settings import LabSettings, LabSettingsError
from tools.lab.common import lab_server_settings
from tools.lab.naive import LAB_POLICIES, NAIVE_QUEUE_POLICY, NaiveStepping, NaiveStream


def test_naive_is_no_policy_of_the_service_but_the_lab_measures_it() -> None:
    with pytest.raises(ValueError):
        PolicyName("naive")
    assert LAB_POLICIES == ("naive", "unbounded", "pause", "drop", "pause-drop")


async def test_one_slow_reader_delays_everyone_under_the_labs_naive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async def naive(slow_readers: int) -> list[float]:
        return await healthy_durations(
            NAIVE_QUEUE_POLICY, slow_readers=slow_readers,
            run_step=lambda hub: NaiveStepping(hub, step=fixed_cost_step()),
            stream_type=NaiveStream)

    assert await naive(0) == [TOKENS * STEP_S] * 8
    # After each step the loop waits for the slow reader to take its token. It takes
    # token 0 at once (it was waiting), then one every SLOW_READ_S; step k + 1 starts
    # when it has taken token k - 1, so the last step ends 14 reads and 2 steps in.
    assert await naive(1) == [(TOKENS - 2) * SLOW_READ_S + 2 * STEP_S] * 7


async def test_a_stream_that_picks_its_own_policy_is_not_waited_for(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # As on a server whose default policy was naive: a request's own policy is not naive.
    done: dict[str, float] = {}
    start = trio.current_time()
    settings = HubSettings(policy=NAIVE_QUEUE_POLICY)
    engine = ScriptedEngine(batch_limit=8)
    opened: list[Hub] = []
    naive = NaiveStepping(lambda: opened[0] if opened else None, step=fixed_cost_step())
    async with (open_hub(engine, settings, run_step=naive, stream_type=NaiveStream) as hub,
                trio.open_nursery() as readers):
        opened.append(hub)
        slow = hub.open_stream(request("slow", TOKENS), policy=PolicyName.UNBOUNDED)
        readers.start_soon(read_all, slow, SLOW_READ_S, done)
        fast = hub.open_stream(request("fast", TOKENS))
        readers.start_soon(read_all, fast, 0, done)
    assert done["fast"] - start == TOKENS * STEP_S


def test_the_lab_server_takes_naive_as_its_device() -> None:
    assert lab_server_settings({"policy": "naive", "queue_limit": 8}) == {
        "policy": "unbounded", "lab_naive": "true", "queue_limit": 8}
    assert lab_server_settings({"policy": "drop"}) == {"policy": "drop"}
    assert LabSettings.from_env({"STREAMSCOPE_LAB_NAIVE": "true"}).naive
    assert not LabSettings.from_env({}).naive
    with pytest.raises(LabSettingsError, match="STREAMSCOPE_LAB_NAIVE"):
        LabSettings.from_env({"STREAMSCOPE_LAB_NAIVE": "maybe"})
