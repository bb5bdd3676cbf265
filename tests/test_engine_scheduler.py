"""Scheduling without torch: the real Engine and Scheduler over a scripted runner.

Which prompts share a prefill pass, who is decoded together, in what order requests
are admitted, and how a sequence ends are decisions of the scheduler; here they are
checked with ``tests.scripted_runner`` (letters count up; ``z`` is followed by eos),
so no model is loaded. One test checks that none of this imports torch.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine import EngineEvent, FinishEvent, FinishReason, GenerationRequest, TokenEvent
from engine.block_allocator import BlockAllocator
from engine.costs import StepCosts
from engine.engine import Engine
from engine.scheduler import Scheduler
from tests.engine_steps import run_until_idle
from tests.scripted_runner import ScriptedRunner, scripted_engine
from tools.lab.reservation import RESERVATION

REPO_ROOT = Path(__file__).resolve().parent.parent


def _submit(engine: Engine, request_id: str, prompt: str = "abcd", max_new: int = 4) -> None:
    engine.submit(GenerationRequest(request_id, prompt, max_new))


def _text(events: list[EngineEvent], request_id: str) -> str:
    tokens = [e for e in events if isinstance(e, TokenEvent) and e.request_id == request_id]
    return "".join(e.text for e in tokens)


def _finish(events: list[EngineEvent], request_id: str) -> FinishEvent:
    (finish,) = [e for e in events if isinstance(e, FinishEvent) and e.request_id == request_id]
    return finish


def test_the_engine_and_scheduler_run_without_torch() -> None:
    script = textwrap.dedent(
        """
        import sys
        from engine import GenerationRequest
        from tests.scripted_runner import scripted_engine
        engine = scripted_engine()
        engine.submit(GenerationRequest("a", "wx", 4))
        while engine.has_work():
            engine.step()
        assert "torch" not in sys.modules, "torch was imported"
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr


def test_the_scripted_model_counts_up_to_z_then_ends_with_eos() -> None:
    engine = scripted_engine()
    _submit(engine, "a", "uvw", 10)
    events = run_until_idle(engine)
    assert _text(events, "a") == "xyz"
    assert (_finish(events, "a").reason, _finish(events, "a").completion_tokens) == (
        FinishReason.EOS, 4,  # x, y, z and the eos token
    )


def test_prompts_within_the_budget_share_one_prefill_pass() -> None:
    runner = ScriptedRunner()
    engine = scripted_engine(runner, max_prefill_tokens=8)
    for request_id in ("r0", "r1", "r2", "r3", "r4"):
        _submit(engine, request_id, "abcd", 2)  # 4 tokens each: two per pass
    run_until_idle(engine)
    assert runner.prefills == [["r0", "r1"], ["r2", "r3"], ["r4"]]


def test_running_sequences_decode_every_step_while_a_burst_is_prefilled() -> None:
    runner = ScriptedRunner()
    engine = scripted_engine(runner, max_prefill_tokens=4)
    _submit(engine, "running", "a", 8)
    engine.step()
    for request_id in ("b0", "b1", "b2"):
        _submit(engine, request_id, "abcd", 4)
    for _ in range(3):
        engine.step()
    assert runner.prefills == [["running"], ["b0"], ["b1"], ["b2"]]
    assert runner.decodes == [["running"], ["running", "b0"], ["running", "b0", "b1"]]


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks() -> None:
    runner = ScriptedRunner()
    engine = scripted_engine(runner, max_prefill_tokens=4)
    _submit(engine, "running", "a", 8)
    engine.step()
    _submit(engine, "long", "abcdefghij", 2)  # 10 tokens: chunks of 4, 4 and 2
    _submit(engine, "short", "ab", 2)
    events = run_until_idle(engine)
    assert runner.chunks[1:] == [
        [("long", 0, 4)], [("long", 4, 8)], [("long", 8, 10), ("short", 0, 2)]
    ]
    firsts = [e.request_id for e in events if isinstance(e, TokenEvent) and e.index == 0]
    assert firsts == ["long", "short"]  # the first token comes with the last chunk
    assert runner.decodes[:3] == [["running"]] * 3  # never held up by the long prompt
    assert _text(events, "long") == "kl"


def test_a_step_time_target_sets_the_prefill_budget_from_measured_costs() -> None:
    scheduler = Scheduler(
        BlockAllocator(8, 4), max_batch=8, max_prefill_tokens=1000, eos_token_ids=frozenset(),
        max_step_ms=100.0,
    )
    assert scheduler.prefill_budget(1) == 1000  # nothing measured yet: the token cap
    costs = scheduler.costs
    for tokens, ms in ((16, 12.0), (64, 36.0), (16, 12.0), (64, 36.0)):
        costs.observe_prefill(tokens, ms)  # 4 ms + 0.5 ms per token
    costs.observe_decode(1, 20.0)
    costs.observe_decode(9, 40.0)
    assert scheduler.prefill_budget(1) == 152  # (100 - 20 - 4) / 0.5
    assert scheduler.prefill_budget(5) == 132  # (100 - 30 - 4) / 0.5
    assert scheduler.prefill_budget(0) == 1000  # nobody decodes: nobody waits
    assert scheduler.prefill_budget(9) == 112  # (100 - 40 - 4) / 0.5
    assert scheduler.prefill_budget(1000) == 92  # decode fills it: (50 - 4) / 0.5, the least


def test_the_margin_is_a_high_quantile_of_recent_overruns_within_bounds() -> None:
    costs = StepCosts()
    for _ in range(3):
        costs.observe_step(100.0, 150.0)
    assert costs.margin() == 1.0  # too few planned steps to tell
    costs.observe_step(100.0, 120.0)
    assert costs.margin() == pytest.approx(1.5)  # 4 seen: the largest
    for _ in range(28):
        costs.observe_step(100.0, 90.0)
    # 32 in the window: 3 at 1.5, 1 at 1.2, 28 at 0.9; the 95th percentile is 1.5
    assert costs.margin() == pytest.approx(1.5)
    for _ in range(2):
        costs.observe_step(100.0, 90.0)  # two of the 1.5s leave the window
    assert costs.margin() == pytest.approx(1.2)  # the last 1.5, one in 32, is ignored
    costs.observe_step(100.0, 90.0)
    assert costs.margin() == pytest.approx(0.9)  # one outlier in 32: planned too long
    for _ in range(32):
        costs.observe_step(100.0, 1000.0)
    assert costs.margin() == 2.0  # a stalled machine halves the budget's room at most


def test_the_budget_is_planned_within_the_target_over_the_margin() -> None:
    scheduler = Scheduler(
        BlockAllocator(8, 4), max_batch=8, max_prefill_tokens=1000, eos_token_ids=frozenset(),
        max_step_ms=100.0,
    )
    costs = scheduler.costs
    for tokens, ms in ((16, 12.0), (64, 36.0)):
        costs.observe_prefill(tokens, ms)  # 4 ms + 0.5 ms per token
    costs.observe_decode(1, 20.0)
    assert scheduler.prefill_budget(1) == 152  # (100 - 20 - 4) / 0.5
    for _ in range(4):
        costs.observe_step(100.0, 125.0)  # planned steps ran 1.25x their plan
    assert scheduler.prefill_budget(1) == 112  # (100 / 1.25 - 20 - 4) / 0.5


def test_a_step_with_prompt_tokens_and_decode_rows_is_planned_and_compared() -> None:
    runner = ScriptedRunner()
    engine = scripted_engine(runner, max_step_ms=1e9, max_prefill_tokens=4)
    engine.costs = engine.scheduler.costs = costs = StepCosts()
    for tokens, ms in ((1, 1e6), (4, 4e6)):
        costs.observe_prefill(tokens, ms)  # planned: a million ms a token
    costs.observe_decode(1, 1e6)
    _submit(engine, "running", "a", 20)
    engine.step()  # its prefill, nobody decoding: not planned
    _submit(engine, "long", "b" * 16, 1)
    calibration = runner.mixes
    for _ in range(4):
        engine.step()  # 4 chunks of "long" beside "running"'s decode row
    assert runner.mixes - calibration == 4
    assert costs.margin() == 0.5  # 4 steps far under plan: the lower bound
    assert engine.statistics().step_margin == 0.5  # what /stats and /metrics report
    engine.cancel("running")
    engine.step()


def test_an_engine_with_a_step_time_target_calibrates_at_once() -> None:
    runner = ScriptedRunner()
    engine = scripted_engine(runner, max_step_ms=50.0)
    assert engine.costs.prefill_line() is not None
    assert engine.costs.decode_ms(8) is not None
    assert engine.statistics().admitted == engine.statistics().releases == 0


def test_admission_waits_for_blocks_in_arrival_order() -> None:
    runner = ScriptedRunner()
    engine = scripted_engine(runner, num_blocks=4, block_size=4, admission=RESERVATION)
    _submit(engine, "first", "abcd", 4)  # 8 positions: 2 of the 4 blocks
    _submit(engine, "big", "abcdefgh", 4)  # 12 positions: 3 blocks, only 2 free
    _submit(engine, "small", "a", 3)  # 4 positions: 1 block, would fit at once
    run_until_idle(engine)
    assert runner.prefills == [["first"], ["big", "small"]]  # "small" never overtakes "big"


def test_a_paused_sequence_leaves_the_decode_batch_and_has_work_says_so() -> None:
    runner = ScriptedRunner()
    engine = scripted_engine(runner, max_batch=1)
    _submit(engine, "a", "a", 10)
    _submit(engine, "w", "a", 2)  # waits for the only slot
    engine.step()
    engine.pause("a")
    engine.step()
    assert not engine.has_work()  # "w" cannot be admitted, "a" is paused
    engine.resume("a")
    assert engine.has_work()
    engine.cancel("a")
    events = run_until_idle(engine)
    assert runner.decodes == [["w"]]
    assert _finish(events, "w").reason is FinishReason.LENGTH


def test_a_stop_string_across_tokens_ends_the_sequence_without_its_text() -> None:
    engine = scripted_engine()
    engine.submit(GenerationRequest("a", "c", 20, stop=("fg",)))
    events = run_until_idle(engine)
    assert _text(events, "a") == "de"
    assert _finish(events, "a").reason is FinishReason.STOP


def test_a_failed_packed_prefill_is_retried_one_prompt_at_a_time() -> None:
    runner = ScriptedRunner(fail_prefill=frozenset({"bad"}))
    engine = scripted_engine(runner)
    for request_id in ("r0", "bad", "r1"):
        _submit(engine, request_id)
    events = run_until_idle(engine)
    assert runner.prefills[:4] == [["r0", "bad", "r1"], ["r0"], ["bad"], ["r1"]]
    assert _finish(events, "bad").error == "prefill failed: scripted prefill failure"
    assert [_finish(events, r).reason for r in ("r0", "r1")] == [FinishReason.LENGTH] * 2


def test_a_failed_decode_pass_ends_every_sequence_in_it() -> None:
    runner = ScriptedRunner(fail_decode=frozenset({"bad"}))
    engine = scripted_engine(runner)
    _submit(engine, "ok")
    _submit(engine, "bad")
    events = run_until_idle(engine)
    assert [_finish(events, r).error for r in ("ok", "bad")] == [
        "decode failed: scripted decode failure"
    ] * 2


def test_a_sampling_failure_ends_only_its_sequence() -> None:
    engine = scripted_engine(ScriptedRunner(fail_sample=frozenset({"bad"})))
    _submit(engine, "ok")
    _submit(engine, "bad")
    events = run_until_idle(engine)
    bad = _finish(events, "bad")
    assert (bad.reason, bad.completion_tokens) == (FinishReason.ERROR, 0)
    assert bad.error == "token 0 failed: ScriptedFault('scripted sampling failure')"
    assert _text(events, "ok") == "efgh"
    assert engine.statistics().releases == 2


@pytest.mark.parametrize("max_new", [1, 3])
def test_length_ends_at_max_new_tokens_and_releases_once(max_new: int) -> None:
    engine = scripted_engine()
    _submit(engine, "a", "a", max_new)
    events = run_until_idle(engine)
    assert (_finish(events, "a").reason, _finish(events, "a").completion_tokens) == (
        FinishReason.LENGTH, max_new,
    )
    engine.step()
    stats = engine.statistics()
    assert (stats.releases, stats.blocks_free) == (1, stats.blocks_total)


def test_the_ttft_estimate_counts_the_prompt_tokens_ahead_and_the_steps_they_take() -> None:
    engine = scripted_engine(max_prefill_tokens=8)
    assert engine.estimate_ttft_ms(4) is None  # nothing measured
    _submit(engine, "a", "abcd", 20)
    engine.step()  # "a" decodes from now on
    engine.costs = engine.scheduler.costs = StepCosts()  # known costs instead of measured
    for tokens, ms in ((4, 6.0), (8, 8.0)):
        engine.costs.observe_prefill(tokens, ms)  # 4 ms + 0.5 ms per token
    engine.costs.observe_decode(1, 10.0)
    _submit(engine, "b", "abcd")
    _submit(engine, "c", "abcdefgh")
    estimate = engine.estimate_ttft_ms(4)
    in_flight = engine.statistics().last_step_ms
    assert estimate is not None and in_flight is not None
    # 4 + 8 tokens ahead and 4 of its own: two steps of 8, each with a's decode.
    assert estimate - in_flight == pytest.approx(2 * (10.0 + 4.0) + 0.5 * 16)
    engine.cancel("a")
