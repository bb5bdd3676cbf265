"""One set of scenarios, three engines, one behaviour.

The same scripted scenarios (submits, cancels, pauses and resumes between steps) run
on the real Engine over the scripted runner, on the real Engine over the tiny GPT-2
model, and on the hub tests' ``ScriptedEngine`` fake; each step's events (which
request, which token index or finish reason, handed to ``on_prefill`` or returned)
and ``has_work()`` after it must be the same on all three. Token ids and text are
the model's own and are not compared. So the fake the hub is tested against cannot
drift from the engine it stands for, and the scripted runner that the scheduling
tests use behaves as the model does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import pytest

from engine import EngineEvent, FinishEvent, GenerationRequest, SamplingParams
from engine.engine import Engine
from tests.fakes import ScriptedEngine
from tests.scripted_runner import scripted_engine

FIXED = SamplingParams(ignore_eos=True)  # the random model's eos must not end a run
PROMPT = "a b c d"  # short in every tokenizer: far under the prefill budget

Action = tuple[str, str] | tuple[str, str, int]  # (op, request id[, max_new_tokens])
# Each scenario: the actions before each step; then steps run until has_work() is False.
SCENARIOS: dict[str, list[list[Action]]] = {
    "burst-over-the-batch-limit": [
        [("submit", "r0", 3), ("submit", "r1", 5), ("submit", "r2", 2), ("submit", "r3", 4)],
    ],
    "cancel-waiting-and-running": [
        [("submit", "a", 6), ("submit", "b", 6), ("submit", "w", 3)],
        [("cancel", "w"), ("submit", "c", 2)],
        [("cancel", "a")],
        [("cancel", "a"), ("cancel", "nobody")],
    ],
    "cancel-before-the-first-step": [
        [("submit", "a", 3), ("cancel", "a"), ("submit", "b", 2)],
    ],
    "pause-with-a-waiter": [
        [("submit", "a", 5), ("submit", "b", 4), ("submit", "w", 2)],
        [("pause", "a"), ("pause", "b")],
        [],
        [("resume", "a")],
        [("resume", "b")],
    ],
    "pause-before-admission-then-cancel": [
        [("submit", "a", 4), ("pause", "a")],
        [],
        [("cancel", "a")],
    ],
}
MAX_BATCH = 2

Trace = list[tuple[list[tuple[str, ...]], bool]]


class Stepped(Protocol):
    def submit(self, request: GenerationRequest, resume_from: Sequence[int] = ()) -> int: ...
    def cancel(self, request_id: str) -> None: ...
    def pause(self, request_id: str) -> None: ...
    def resume(self, request_id: str) -> None: ...
    def has_work(self) -> bool: ...
    def step(
        self, on_prefill: Callable[[list[EngineEvent]], None] | None = None
    ) -> list[EngineEvent]: ...


def _shape(event: EngineEvent, phase: str) -> tuple[str, ...]:
    if isinstance(event, FinishEvent):
        return (phase, event.request_id, event.reason.value, str(event.completion_tokens))
    return (phase, event.request_id, f"token {event.index}")


def _trace(engine: Stepped, scenario: list[list[Action]], max_steps: int = 60) -> Trace:
    trace: Trace = []
    for step in range(max_steps):
        if step < len(scenario):
            for op, request_id, *max_new in scenario[step]:
                if op == "submit":
                    engine.submit(GenerationRequest(request_id, PROMPT, max_new[0], sampling=FIXED))
                else:
                    getattr(engine, op)(request_id)
        elif not engine.has_work():
            return trace
        early: list[EngineEvent] = []
        late = engine.step(on_prefill=early.extend)
        shapes = [_shape(e, "early") for e in early] + [_shape(e, "late") for e in late]
        trace.append((shapes, engine.has_work()))
    raise AssertionError(f"still working after {max_steps} steps")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scripted_runner_model_and_fake_engine_behave_alike(
    name: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    scenario = SCENARIOS[name]
    model = _trace(make_tiny_engine(max_batch=MAX_BATCH, num_blocks=64, block_size=4), scenario)
    assert _trace(scripted_engine(max_batch=MAX_BATCH), scenario) == model
    assert _trace(ScriptedEngine(batch_limit=MAX_BATCH), scenario) == model
