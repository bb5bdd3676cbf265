"""The band yielding (``Scheduler.lower_band_budget``): while a higher band has decode
rows in a step, a lower band's prompt chunks get a bounded share of the prefill budget,
never none; a higher band's own prompts and a band decoding alone keep the whole budget.

On the real Engine over the scripted runner (one token a character); the costs are
replaced before each step, so the plan is the rule's and not this machine's timing.
"""

from __future__ import annotations

from engine import GenerationRequest, SamplingParams
from engine.costs import StepCosts
from engine.engine import Engine
from engine.scheduler import LOWER_BAND_UNMEASURED_SHARE, MIN_PREFILL_TOKENS
from tests.engine_steps import run_until_idle
from tests.scripted_runner import scripted_engine

BUDGET = 256
LONG_PROMPT = "abcdefghijklmnopqrstuvwxy" * 8  # 200 tokens


def _submit(engine: Engine, request_id: str, priority: int, prompt: str, max_new: int) -> None:
    engine.submit(GenerationRequest(request_id, prompt, max_new, priority=priority,
                                    sampling=SamplingParams(ignore_eos=True)))


def _step_unmeasured(engine: Engine) -> None:
    """One step planned with no costs measured (the fixed share of the budget)."""
    engine.costs = engine.scheduler.costs = StepCosts()
    engine.step()


def test_a_lower_bands_prompt_beside_a_higher_bands_decode_rows_is_bounded_and_progresses(
) -> None:
    engine = scripted_engine(max_prefill_tokens=BUDGET, num_blocks=128)
    _submit(engine, "high", 0, "a", 20)
    _step_unmeasured(engine)  # high's prompt: it decodes from now on
    _submit(engine, "low", 2, LONG_PROMPT, 4)
    share = max(int(BUDGET * LOWER_BAND_UNMEASURED_SHARE), MIN_PREFILL_TOKENS)
    chunks = []  # low's prefilled tokens in each step beside high's decode row
    _step_unmeasured(engine)  # low admitted: its first chunk
    low = engine.scheduler.running["low"]
    chunks.append(low.num_prefilled)
    while low.needs_prefill and "high" in engine.scheduler.running:
        before = low.num_prefilled
        _step_unmeasured(engine)
        chunks.append(low.num_prefilled - before)
    assert not low.needs_prefill and "high" in engine.scheduler.running  # it got through
    assert all(0 < c <= share for c in chunks)  # bounded, and progressing, every step
    assert chunks[0] == share < len(LONG_PROMPT)  # the whole budget would take it all
    run_until_idle(engine)


def test_a_lower_band_decoding_alone_keeps_the_whole_budget() -> None:
    engine = scripted_engine(max_prefill_tokens=BUDGET, num_blocks=128)
    _submit(engine, "other", 2, "a", 20)
    _step_unmeasured(engine)  # a stream of the same band decodes: no band above it
    _submit(engine, "low", 2, LONG_PROMPT, 4)
    _step_unmeasured(engine)
    assert engine.scheduler.running["low"].num_prefilled == len(LONG_PROMPT)
    run_until_idle(engine)


def test_a_higher_bands_prompt_keeps_the_whole_budget_beside_its_own_decode_rows() -> None:
    engine = scripted_engine(max_prefill_tokens=BUDGET, num_blocks=128)
    _submit(engine, "high", 0, "a", 20)
    _step_unmeasured(engine)
    _submit(engine, "high2", 0, LONG_PROMPT, 4)
    _step_unmeasured(engine)
    assert engine.scheduler.running["high2"].num_prefilled == len(LONG_PROMPT)
    run_until_idle(engine)


def test_measured_costs_bound_a_lower_band_to_half_a_decode_pass_never_under_the_floor(
) -> None:
    scheduler = scripted_engine(max_prefill_tokens=BUDGET).scheduler
    scheduler.mixed_step = False  # the prefill line prices the prompt tokens
    costs = scheduler.costs = StepCosts()
    for tokens, ms in ((8, 8.0), (32, 20.0)):
        costs.observe_prefill(tokens, ms)  # 4 ms + 0.5 ms per token
    costs.observe_decode(2, 40.0)
    assert scheduler.lower_band_budget(2, BUDGET) == (40.0 * 0.5 - 4.0) / 0.5  # 32
    assert scheduler.lower_band_budget(2, 8) == 8  # never over the step's budget
    costs.observe_decode(4, 10.0)  # half of 10 ms fits fewer than the floor
    assert scheduler.lower_band_budget(4, BUDGET) == MIN_PREFILL_TOKENS
