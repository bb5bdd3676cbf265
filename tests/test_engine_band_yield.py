"""The band yielding (``engine.band_yield``, applied by ``Scheduler.schedule``): in a step
of decode rows only, a lower band's prompt chunks beside a higher band's rows get a bounded
share, never none; in a step with a higher band's prompt, the lower band's decode rows ride
within the cost limit, in turn, at least one; a higher band's own prompts and a band with
none above it keep the whole budget.

On the real Engine over the scripted runner (one token a character); the costs are
replaced before each step, so the plan is the rule's and not this machine's timing.
"""

from __future__ import annotations

from engine import GenerationRequest, SamplingParams
from engine.band_yield import (
    LOWER_BAND_FLOOR_TOKENS,
    LOWER_BAND_STEP_SHARE,
    LOWER_BAND_UNMEASURED_SHARE,
    BandYield,
)
from engine.costs import StepCosts
from engine.engine import Engine
from engine.sequence import Sequence
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
    share = max(int(BUDGET * LOWER_BAND_UNMEASURED_SHARE), LOWER_BAND_FLOOR_TOKENS)
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


def _measured(costs: StepCosts) -> StepCosts:
    """Costs as a machine might measure them: a prefill pass 4 ms + 0.5 ms a token; a
    decode pass 20 ms at 1 row, 24 at 2, 40 at 8."""
    for tokens, ms in ((8, 8.0), (32, 20.0)):
        costs.observe_prefill(tokens, ms)
    for rows, ms in ((1, 20.0), (2, 24.0), (8, 40.0)):
        costs.observe_decode(rows, ms)
    return costs


def test_measured_costs_bound_the_step_to_a_share_over_the_higher_bands_rows() -> None:
    rule = BandYield(_measured(StepCosts()), False, BUDGET)
    limit = rule.limit_ms(1, 0)  # one higher decode row alone: 20 ms
    assert limit == 20.0 * (1 + LOWER_BAND_STEP_SHARE)
    rows = [_row(f"low{i}", waited=i) for i in range(7)]
    riding = rule.decode_rows(rows, 1, 0, limit, lambda s: s.last_decode_plan)
    # 1 + n rows within 25 ms: 2 rows 24 ms, 3 rows 26.7 (interpolated): one lower row,
    # the one that waited longest
    assert [s.request.request_id for s in riding] == ["low6"]
    assert rule.decode_rows(rows, 1, 0, 10.0, lambda s: s.last_decode_plan) == rows[-1:]
    assert rule.prompt_budget(2, BUDGET) == LOWER_BAND_FLOOR_TOKENS  # 24 ms: none fits, the floor
    slow = StepCosts()
    for tokens, ms in ((8, 8.0), (32, 20.0)):
        slow.observe_prefill(tokens, ms)  # 4 ms + 0.5 ms a token
    slow.observe_decode(2, 200.0)
    decode = 200.0
    wide = BandYield(slow, False, BUDGET)
    expected = int((decode * (1 + LOWER_BAND_STEP_SHARE) - decode - 4.0) / 0.5)
    assert expected > LOWER_BAND_FLOOR_TOKENS
    assert wide.prompt_budget(2, BUDGET) == expected
    assert wide.prompt_budget(2, 8) == 8  # never over the step's budget


def test_where_only_full_batches_ran_the_reference_is_not_overestimated() -> None:
    """A flood keeps the batch full, so the costs may have seen only 8-row passes: the
    higher band's one row alone is then estimated lower (``decode_ms_low``), not as an
    8-row pass, which would let the whole flood ride; the lower rows are priced as seen."""
    costs = StepCosts()
    costs.observe_decode(8, 40.0)
    assert costs.decode_ms(1) == 40.0  # the planning estimate: not assumed cheaper
    assert costs.decode_ms_low(1) == 40.0 * (1 / 8) ** 0.5
    assert costs.decode_ms_low(9) == costs.decode_ms(9)  # above what was seen: the same
    rule = BandYield(costs, False, BUDGET)
    limit = rule.limit_ms(1, 0)
    assert limit == 40.0 * (1 / 8) ** 0.5 * (1 + LOWER_BAND_STEP_SHARE)
    rows = [_row(f"low{i}", waited=i) for i in range(7)]
    assert len(rule.decode_rows(rows, 1, 0, limit, lambda s: s.last_decode_plan)) == 1


def test_before_costs_are_measured_every_row_rides_and_prompts_get_the_fixed_share() -> None:
    rule = BandYield(StepCosts(), False, BUDGET)
    assert rule.limit_ms(1, 0) is None
    rows = [_row(f"low{i}", waited=i) for i in range(3)]
    assert rule.decode_rows(rows, 1, 0, None, lambda s: s.last_decode_plan) == rows
    assert rule.prompt_budget(4, BUDGET) == int(BUDGET * LOWER_BAND_UNMEASURED_SHARE)


def test_a_higher_bands_prompt_step_carries_few_lower_rows_and_the_next_carries_all() -> None:
    """A step with a higher band's prompt carries the lower band's decode rows only as the
    costs allow (here one: the floor), the one that waited longest; the next step, decode
    rows only, carries them all again, and every answer is whole."""
    engine = scripted_engine(max_prefill_tokens=BUDGET, num_blocks=128)
    for i in range(3):
        _submit(engine, f"low{i}", 2, "x", 40)
    _step_unmeasured(engine)  # the lower prompts: they decode from now on
    _step_unmeasured(engine)
    running = engine.scheduler.running
    for k in range(4):
        _submit(engine, f"high{k}", 0, "a", 2)
        before = {rid: len(running[rid].generated_ids) for rid in ("low0", "low1", "low2")}
        engine.costs = engine.scheduler.costs = _measured(StepCosts())
        engine.step()  # high{k}'s prompt: its first token waits for this step
        assert f"high{k}" in running and running[f"high{k}"].generated_ids
        grew = [rid for rid in before if len(running[rid].generated_ids) > before[rid]]
        assert grew == [f"low{k % 3}"]  # one lower row, in rotation
        before = {rid: len(running[rid].generated_ids) for rid in before}
        engine.costs = engine.scheduler.costs = _measured(StepCosts())
        engine.step()  # decode rows only: every lower row rides
        assert all(len(running[rid].generated_ids) == before[rid] + 1 for rid in before)
    run_until_idle(engine)


def _row(request_id: str, waited: int) -> Sequence:
    """A sequence stand-in for the rule's ranking (it reads only what ``waited`` does)."""
    return Sequence(GenerationRequest(request_id, "x", 1), [1], None, None, None,  # type: ignore[arg-type]
                    last_decode_plan=waited)
