"""A burst of arrivals is prefilled a few prompts per step, never stalling running streams.

``max_prefill_tokens`` bounds the prompt tokens prefilled in one step (at least one
prompt always runs); the rest stay admitted and are prefilled in later steps, in
arrival order, while every running sequence still decodes one token per step.
"""

from __future__ import annotations

from collections.abc import Callable

from engine import GenerationRequest, SamplingParams, TokenEvent
from engine.engine import Engine

MakeEngine = Callable[..., Engine]
FIXED = SamplingParams(ignore_eos=True)
PROMPT = "The capital of France is"  # 8 tokens with the tiny tokenizer


def first_tokens_per_step(engine: Engine, ids: list[str]) -> list[list[str]]:
    """Which of ``ids`` got their first token in each step, until all have one."""
    seen: set[str] = set()
    per_step = []
    while len(seen) < len(ids):
        events = engine.step()
        firsts = [e.request_id for e in events if isinstance(e, TokenEvent) and e.index == 0]
        seen.update(firsts)
        per_step.append(firsts)
    return per_step


def test_burst_is_prefilled_within_the_budget_in_arrival_order(
    make_tiny_engine: MakeEngine,
) -> None:
    engine = make_tiny_engine(max_batch=8, num_blocks=64, block_size=8, max_prefill_tokens=16)
    ids = [f"r{i}" for i in range(6)]
    for request_id in ids:
        assert engine.submit(GenerationRequest(request_id, PROMPT, 12, sampling=FIXED)) == 8

    assert first_tokens_per_step(engine, ids) == [ids[0:2], ids[2:4], ids[4:6]]
    for request_id in ids:
        engine.cancel(request_id)


def test_running_sequences_decode_every_step_while_a_burst_is_prefilled(
    make_tiny_engine: MakeEngine,
) -> None:
    engine = make_tiny_engine(max_batch=8, num_blocks=64, block_size=8, max_prefill_tokens=8)
    engine.submit(GenerationRequest("running", PROMPT, 20, sampling=FIXED))
    engine.step()
    burst = [f"b{i}" for i in range(4)]
    for request_id in burst:
        engine.submit(GenerationRequest(request_id, PROMPT, 4, sampling=FIXED))

    steps = [engine.step() for _ in range(4)]

    running_tokens = [[e.index for e in s if e.request_id == "running"] for s in steps]
    assert running_tokens == [[1], [2], [3], [4]]
    firsts = [[e.request_id for e in s if isinstance(e, TokenEvent) and e.index == 0]
              for s in steps]
    assert firsts == [[b] for b in burst]
    engine.cancel("running")


def test_a_prompt_longer_than_the_budget_still_runs_alone(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine(max_batch=8, num_blocks=64, block_size=8, max_prefill_tokens=1)
    engine.submit(GenerationRequest("long", PROMPT, 2, sampling=FIXED))
    engine.submit(GenerationRequest("next", PROMPT, 2, sampling=FIXED))

    assert first_tokens_per_step(engine, ["long", "next"]) == [["long"], ["next"]]
    engine.cancel("long")
    engine.cancel("next")
