"""The stepping thread's own path (``streams/stepper.py``), deterministic: a real worker
thread (``trio.to_thread.run_sync``, as the hub runs it) over an engine that counts its
steps, with no HTTP and no timing. What is checked does not depend on how fast either
thread runs: how the steps' events are grouped into routings, in order; that the thread
is never more than ``steps_ahead`` steps ahead of the routing; and that a routing that
raises stops the stepping without reaching Trio's queue."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import trio

from engine import EngineEvent, GenerationRequest, TokenEvent
from streams.stepper import Stepper


class CountingEngine:
    """Makes ``total`` steps of one token each (the token's index is the step's), then
    has no work. Only ``step`` and ``has_work`` are called, in the stepping thread."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.steps = 0
        self.lock = threading.Lock()

    def submit(self, request: GenerationRequest, resume_from: Sequence[int] = ()) -> int:
        raise AssertionError("not used")

    def step(self, on_prefill: object = None) -> list[EngineEvent]:
        with self.lock:
            index = self.steps
            self.steps += 1
        return [TokenEvent("r", index, index, "x")]

    def has_work(self) -> bool:
        with self.lock:
            return self.steps < self.total


class Routings:
    """What was routed, one list of token indices per routing, and how many steps the
    engine had made at each routing's start."""

    def __init__(self, engine: CountingEngine, fail_at: int | None = None) -> None:
        self.engine = engine
        self.fail_at = fail_at
        self.groups: list[list[int]] = []
        self.batches = 0
        self.steps_seen: list[int] = []

    def route(self, events: list[EngineEvent]) -> None:
        self.batches += 1
        if self.batches == self.fail_at:
            raise RuntimeError("routing failed")
        self.steps_seen.append(self.engine.steps)
        self.groups.append([e.index for e in events if isinstance(e, TokenEvent)])


async def run_in_thread(stepper: Stepper) -> bool:
    stepper.bind()
    backed_off = await trio.to_thread.run_sync(stepper.run_steps)
    stepper.release()  # what the hub does with what is still held
    return backed_off


def flattened(groups: list[list[int]]) -> list[int]:
    return [i for group in groups for i in group]


async def test_while_writers_are_busy_steps_are_routed_steps_ahead_at_a_time() -> None:
    engine = CountingEngine(total=7)
    routings = Routings(engine)
    batches: list[int] = []

    def route(events: list[EngineEvent]) -> None:
        batches.append(len(events))
        routings.route(events)

    stepper = Stepper(engine, route, hold=lambda: True, steps_ahead=3)

    assert await run_in_thread(stepper) is False  # it stopped for want of work
    assert flattened(routings.groups) == list(range(7))  # every step once, in order
    assert stepper.routings == 3  # steps 0-2, then 3-5 (the bound), then 6 (released)
    # The thread waited at the bound: at each forced routing it had made exactly that
    # many steps, never a fourth unrouted one.
    assert routings.steps_seen[:3] == [3, 3, 3] and routings.steps_seen[3:6] == [6, 6, 6]


async def test_with_writers_caught_up_each_step_is_routed_as_it_comes() -> None:
    engine = CountingEngine(total=5)
    routings = Routings(engine)
    stepper = Stepper(engine, routings.route, hold=lambda: False, steps_ahead=4)

    await run_in_thread(stepper)

    assert routings.groups == [[0], [1], [2], [3], [4]]
    assert stepper.routings == 5


async def test_caught_up_routes_what_is_held_once_it_makes_a_stride() -> None:
    engine = CountingEngine(total=2)
    routings = Routings(engine)
    holding = True
    stepper = Stepper(engine, routings.route, hold=lambda: holding, steps_ahead=4)
    stepper.bind()

    await trio.to_thread.run_sync(stepper.run_steps)
    assert routings.groups == []  # both steps held: the writers were busy
    holding = False
    stepper.caught_up()

    assert routings.groups == [[0], [1]]


async def test_a_routing_that_raises_stops_the_stepping_and_stays_out_of_trio() -> None:
    engine = CountingEngine(total=1000)
    routings = Routings(engine, fail_at=2)
    stepper = Stepper(engine, routings.route, hold=lambda: False, steps_ahead=2)

    assert await run_in_thread(stepper) is False

    assert isinstance(stepper.failure, RuntimeError)
    assert routings.groups == [[0]]  # nothing routed after the failure
    # The thread saw the stop within the bound: the step in flight, at most steps_ahead
    # unrouted ones, and nothing more.
    assert engine.steps <= 2 + stepper.steps_ahead


async def test_an_engine_that_raises_leaves_the_steps_before_it_routed() -> None:
    engine = CountingEngine(total=10)
    routings = Routings(engine)
    original = engine.step

    def step(on_prefill: object = None) -> list[EngineEvent]:
        if engine.steps == 3:
            raise ValueError("the forward pass failed")
        return original(on_prefill)

    engine.step = step  # type: ignore[method-assign]
    stepper = Stepper(engine, routings.route, hold=lambda: True, steps_ahead=4)
    stepper.bind()

    with pytest.raises(ValueError, match="forward pass"):
        await trio.to_thread.run_sync(stepper.run_steps)
    await trio.testing.wait_all_tasks_blocked()
    stepper.release()

    assert flattened(routings.groups) == [0, 1, 2]
