"""The mixed step: a step's prompt chunks and decode rows in ONE forward pass.

The decode rows of a mixed pass must give the logits a decode pass of the same rows
gives, to float32's rounding (bit for bit on some CPUs: on others the matrix product
takes another path for more rows, 2.6e-6 apart here for the tiny Llama), and the same
argmax, so streams that decode while prompts are prefilled keep their tokens; concurrent
runs with mixed steps (chunks with a cached prefix included) must
match solo runs, greedy and seeded. The step-time budget and the TTFT estimate must
count one pass, not two, once a mixed pass has been measured.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine import EngineEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from engine.block_allocator import BlockAllocator
from engine.costs import StepCosts, cost_tokens
from engine.engine import Engine
from engine.model_runner import ModelRunner
from engine.scheduler import Scheduler
from tests.scripted_runner import ScriptedRunner, scripted_engine

MakeEngine = Callable[..., Engine]
MODELS = pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
GREEDY = SamplingParams(ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
PROMPTS = [
    "The capital of France is",
    "Every stream has an owner, and every way it can end calls one close.",
    "A",
    "Über Straße, naïve café, déjà vu.",
    "tokens leave as they are made",
    "The capital of Italy is Rome. The capital of France is Paris. A stream is an HTTP",
]


def _run(engine: Engine, arrivals: dict[int, list[GenerationRequest]]) -> dict[str, list[int]]:
    """Submit ``arrivals[k]`` before step ``k``; step until idle; token ids per request."""
    ids: dict[str, list[int]] = {}
    for step in range(400):
        for request in arrivals.get(step, []):
            engine.submit(request)
        if step > max(arrivals) and not engine.has_work():
            return ids
        for event in engine.step():
            if isinstance(event, TokenEvent):
                ids.setdefault(event.request_id, []).append(event.token_id)
    raise AssertionError("still working after 400 steps")


def _request(i: int, sampling: SamplingParams, max_new: int = 6) -> GenerationRequest:
    return GenerationRequest(f"r{i}", PROMPTS[i], max_new, sampling=sampling)


@MODELS
def test_a_mixed_pass_gives_its_decode_rows_the_decode_pass_logits(
    make_tiny_engine: MakeEngine, model: str
) -> None:
    engine = make_tiny_engine(model, max_batch=8, num_blocks=128, block_size=4)
    for i in range(4):
        engine.submit(_request(i, GREEDY, 8))
    engine.step()
    engine.step()  # all four decode now
    engine.submit(_request(4, GREEDY))
    engine.submit(_request(5, GREEDY))
    engine.scheduler.apply_inbox()
    plan = engine.scheduler.schedule()
    assert len(plan.prefill) == 2 and len(plan.decode) == 4
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    with torch.inference_mode():
        decoded = runner.decode_logits(plan.decode).clone()
        mixed = runner.mixed_logits(plan.prefill, plan.decode)
    rows = mixed[len(plan.prefill):]
    # 1e-5: the random tiny models' logits are O(1-10); a row attending to the wrong
    # positions, or another row's, differs by O(1).
    torch.testing.assert_close(rows, decoded, rtol=0, atol=1e-5)
    assert torch.equal(rows.argmax(-1), decoded.argmax(-1))
    for seq in [*plan.decode, *(c.seq for c in plan.prefill)]:
        engine.cancel(seq.request_id)


@MODELS
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_streams_with_mixed_steps_match_their_solo_runs(
    make_tiny_engine: MakeEngine, model: str, sampling: SamplingParams
) -> None:
    requests = [_request(i, sampling) for i in range(len(PROMPTS))]
    solo = {}
    for request in requests:
        solo.update(_run(make_tiny_engine(model, num_blocks=64, block_size=4), {0: [request]}))
    # Arrivals while others decode, a budget that chunks the longer prompts: most steps
    # carry chunks (some with a cached prefix) and decode rows in one pass.
    engine = make_tiny_engine(model, max_batch=8, num_blocks=128, block_size=4,
                              max_prefill_tokens=12)
    together = _run(engine, {0: requests[:2], 2: requests[2:4], 3: requests[4:]})
    assert engine.num_mixed_steps >= 4
    assert together == solo


def test_a_step_with_prompts_and_decode_rows_runs_one_pass_unless_told_apart() -> None:
    for mixed_step, passes in ((True, [1, 1, 1]), (False, [2, 2, 2])):
        runner = ScriptedRunner()
        engine = scripted_engine(runner, max_prefill_tokens=4, mixed_step=mixed_step)
        engine.submit(GenerationRequest("running", "a", 8))
        engine.step()
        engine.submit(GenerationRequest("long", "abcdefghij", 2))  # chunks 4, 4, 2
        per_step = []
        for _ in range(3):
            before = len(runner.prefills) + len(runner.decodes) - runner.mixes
            engine.step()
            per_step.append(len(runner.prefills) + len(runner.decodes) - runner.mixes - before)
        assert per_step == passes
        assert runner.chunks[1:] == [[("long", 0, 4)], [("long", 4, 8)], [("long", 8, 10)]]
        assert runner.decodes == [["running"]] * 3
        assert engine.num_mixed_steps == (3 if mixed_step else 0)
        engine.cancel("running")
        engine.cancel("long")
        engine.step()


def test_a_failed_mixed_pass_runs_prefill_and_decode_apart() -> None:
    runner = ScriptedRunner(fail_prefill=frozenset({"bad"}))
    engine = scripted_engine(runner)
    engine.submit(GenerationRequest("running", "a", 3))
    engine.step()
    engine.submit(GenerationRequest("bad", "ab", 3))
    engine.submit(GenerationRequest("good", "ab", 2))
    events = engine.step()
    assert runner.mixes == 0  # the mixed pass raised; then prefill (packed, alone) and decode
    assert runner.prefills[1:] == [["bad", "good"], ["bad"], ["good"]]
    assert runner.decodes == [["running"]]
    finishes = {e.request_id: e for e in events if isinstance(e, FinishEvent)}
    assert finishes["bad"].error == "prefill failed: scripted prefill failure"
    tokens = [(e.request_id, e.index) for e in events if isinstance(e, TokenEvent)]
    assert tokens == [("good", 0), ("running", 1)]
    engine.cancel("running")
    engine.cancel("good")
    engine.step()


def test_on_prefill_gets_every_event_of_a_mixed_step_in_one_call(
    make_tiny_engine: MakeEngine,
) -> None:
    engine = make_tiny_engine()
    engine.submit(GenerationRequest("early", PROMPTS[0], 4, sampling=GREEDY))
    engine.step()
    engine.submit(GenerationRequest("late", PROMPTS[1], 3, sampling=GREEDY))
    calls: list[list[EngineEvent]] = []
    returned = engine.step(on_prefill=calls.append)
    assert [[(e.request_id, getattr(e, "index", None)) for e in c] for c in calls] == [
        [("late", 0), ("early", 1)]
    ]
    assert returned == []
    engine.cancel("early")
    engine.cancel("late")


def _costs() -> StepCosts:
    costs = StepCosts()
    for tokens, ms in ((16, 108.0), (64, 132.0)):
        costs.observe_prefill(tokens, ms)  # a pass: 100 ms + 0.5 ms per token
    costs.observe_decode(8, 120.0)
    return costs


def test_the_budget_of_a_mixed_step_counts_one_pass_once_one_was_measured() -> None:
    scheduler = Scheduler(BlockAllocator(8, 4), max_batch=8, max_prefill_tokens=1000,
                          eos_token_ids=frozenset(), max_step_ms=250.0, costs=_costs())
    assert scheduler.prefill_budget(8) == 60  # two passes: (250 - 120 - 100) / 0.5
    scheduler.mixed_step = True
    assert scheduler.prefill_budget(8) == 60  # no mixed pass seen: the two-pass bound
    for tokens, ms in ((20, 132.0), (100, 172.0)):
        scheduler.costs.observe_mixed(tokens, 8, ms)  # 2 ms + 0.5 ms a token over decode
    assert scheduler.costs.mixed_line() == pytest.approx((2.0, 0.5))
    assert scheduler.prefill_budget(8) == 256  # (250 - 120 - 2) / 0.5
    assert scheduler.prefill_budget(0) == 1000  # nobody decodes: nobody waits


def test_the_ttft_estimate_of_a_mixed_engine_counts_one_pass_a_step() -> None:
    engine = scripted_engine(max_prefill_tokens=8)
    engine.submit(GenerationRequest("a", "abcd", 20))
    engine.step()  # "a" decodes from now on
    engine.costs = engine.scheduler.costs = costs = StepCosts()
    for tokens, ms in ((4, 6.0), (8, 8.0)):
        costs.observe_prefill(tokens, ms)  # 4 ms + 0.5 ms per token
    costs.observe_decode(1, 10.0)
    engine.submit(GenerationRequest("b", "abcd", 4))
    in_flight = engine.statistics().last_step_ms
    assert in_flight is not None
    two_passes = engine.estimate_ttft_ms(4)
    assert two_passes == pytest.approx(in_flight + (10.0 + 4.0) + 0.5 * 8)
    for tokens, ms in ((2, 11.0), (6, 13.0)):
        costs.observe_mixed(tokens, 1, ms)  # 0 ms + 0.5 ms a token over the decode
    # 4 + 4 tokens: one step of 8, one pass with a's decode row.
    assert engine.estimate_ttft_ms(4) == pytest.approx(in_flight + 10.0 + 0.5 * 8)
    engine.cancel("a")
    engine.cancel("b")


@pytest.mark.parametrize("max_step_ms", [None, 1000.0])
def test_with_a_step_target_a_long_prompts_late_chunks_count_their_prefix(
    max_step_ms: float | None,
) -> None:
    runner = ScriptedRunner()
    engine = scripted_engine(runner, max_prefill_tokens=1000, num_blocks=1100,
                             max_step_ms=max_step_ms)
    engine.submit(GenerationRequest("running", "a", 8))
    engine.step()
    engine.submit(GenerationRequest("long", "b" * 4000, 1))
    for _ in range(3):
        engine.step()
    lengths = [end - start for chunks in runner.chunks for (rid, start, end) in chunks
               if rid == "long"]
    if max_step_ms is None:
        assert lengths == [1000, 1000, 1000]  # a token cap counts tokens
    else:  # 1000 / (1 + 1000 / 2100), then from 1677: 1000 / (1 + 1677 / 2100)
        assert lengths == [1000, 677, 556]
        assert all(cost_tokens(n, s) <= 1000 for n, s in zip(lengths, (0, 1000, 1677), strict=True))
    engine.cancel("running")
    engine.cancel("long")
    engine.step()
