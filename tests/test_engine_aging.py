"""Aging, the floor of progress under strict bands (``engine.aging``).

On the real Engine over the scripted runner (letters count up, so every run's text is
known: the text of a run alone) and, for the identity of a stream preempted and aged back
in, on the tiny random model, greedy and seeded. A short aging period (``Aging(period)``)
keeps the runs small; the rule is the same at the default.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine import EngineEvent, FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from engine.aging import PRIORITY_AGING_STEPS, Aging, risen_band
from engine.costs import StepCosts
from engine.engine import Engine
from engine.priority import PRIORITY_PREEMPTION_CAP
from tests.engine_steps import run_until_idle, tokens_by_request
from tests.scripted_runner import scripted_engine

PERIOD = 10
HIGH_ANSWER = 3  # tokens of each request of the endless higher band


def _submit(engine: Engine, request_id: str, priority: int, max_new: int,
            prompt: str = "a", sampling: SamplingParams | None = None) -> None:
    engine.submit(GenerationRequest(request_id, prompt, max_new, priority=priority,
                                    sampling=sampling or SamplingParams()))


class EndlessBand:
    """Keeps one request of ``band`` waiting before every step: a higher band that,
    strictly, would hold the engine's one slot forever."""

    def __init__(self, engine: Engine, band: int = 0) -> None:
        self.engine, self.band, self.sent = engine, band, 0

    def step(self) -> list[EngineEvent]:
        scheduler = self.engine.scheduler
        if not any(s.request.priority == self.band for s in scheduler.waiting):
            _submit(self.engine, f"h{self.sent}", self.band, HIGH_ANSWER)
            self.sent += 1
        return self.engine.step()

    def until(self, done: Callable[[list[EngineEvent]], bool], limit: int) -> tuple[
            list[EngineEvent], int]:
        """Step until ``done(events so far)``; the events and the steps taken."""
        events: list[EngineEvent] = []
        for taken in range(1, limit + 1):
            events += self.step()
            if done(events):
                return events, taken
        raise AssertionError(f"not done within {limit} steps")


def _first_token(request_id: str) -> Callable[[list[EngineEvent]], bool]:
    return lambda events: any(isinstance(e, TokenEvent) and e.request_id == request_id
                              for e in events)


def _finished(request_id: str) -> Callable[[list[EngineEvent]], bool]:
    return lambda events: any(isinstance(e, FinishEvent) and e.request_id == request_id
                              for e in events)


def _aged_engine(period: int = PERIOD, **options: int) -> Engine:
    engine = scripted_engine(max_batch=1, **options)
    engine.scheduler.residency.aging = Aging(period)
    return engine


def test_a_band_rises_one_band_present_a_period_never_above_the_highest() -> None:
    present = {-10, 0, 5}  # the priority tier, default and flex: values 15 apart
    assert risen_band(5, PERIOD - 1, present, PERIOD) == 5
    assert risen_band(5, PERIOD, present, PERIOD) == 0
    assert risen_band(5, 2 * PERIOD, present, PERIOD) == -10
    assert risen_band(5, 50 * PERIOD, present, PERIOD) == -10
    assert risen_band(-10, 50 * PERIOD, present, PERIOD) == -10
    assert PRIORITY_AGING_STEPS >= 100  # long against an interactive request's few steps


def test_a_low_band_behind_an_endless_higher_band_is_admitted_within_the_bound() -> None:
    """Strictly it would wait forever; aged, it is admitted within a period (one band
    above it) plus a higher request's answer (the slot freeing), keeps the band it rose
    to while it runs (the band it overtook does not preempt it back), and its text is
    its run alone."""
    engine = _aged_engine()
    high = EndlessBand(engine)
    first = high.step()  # h0 runs
    _submit(engine, "low", priority=5, max_new=12)
    events, taken = high.until(_first_token("low"), limit=10 * PERIOD)
    events = first + events
    bound = PERIOD + HIGH_ANSWER + 1  # + the step its prefill runs
    assert PERIOD < taken <= bound
    low = engine.scheduler.running["low"]
    assert low.aged_band == 0
    more, _ = high.until(_finished("low"), limit=20)
    assert low.num_preemptions == 0  # h's kept waiting behind it: no preemption back
    text = "".join(map(chr, tokens_by_request(events + more)["low"]))
    assert text == "bcdefghijklm"
    stats = engine.scheduler.residency.bands
    assert stats.aged == {5: 1} and PERIOD <= stats.longest_wait_steps[5] <= bound
    run_until_idle(engine)


def test_a_preempted_low_band_stream_is_aged_back_in_and_finishes() -> None:
    """Preempted once for a higher band (under the cap: it could be again), then waiting
    behind an endless higher band: aged back in within the bound, it runs to its end."""
    engine = _aged_engine()
    _submit(engine, "low", priority=5, max_new=16)
    events = engine.step() + engine.step()  # low runs
    high = EndlessBand(engine)
    events += high.step()
    assert "low" not in engine.scheduler.running  # preempted for h0
    low = next(s for s in engine.scheduler.waiting if s.request_id == "low")
    assert low.num_priority_preemptions == 1 < PRIORITY_PREEMPTION_CAP
    made = len(low.generated_ids)
    back, taken = high.until(lambda evs: "low" in engine.scheduler.running, 10 * PERIOD)
    assert PERIOD < taken <= PERIOD + HIGH_ANSWER
    rest, _ = high.until(_finished("low"), limit=30)
    assert low.num_preemptions == 1  # not preempted back by the band it overtook
    tokens = tokens_by_request(events + back + rest)["low"]
    assert len(tokens) == 16 and made < 16
    assert "".join(map(chr, tokens)) == "bcdefghijklmnopq"
    run_until_idle(engine)


def test_waits_under_the_period_keep_strict_band_order() -> None:
    """Five higher requests (about 4 steps each) pass a waiting low one: under a period
    of 50 steps nothing is lifted, every higher one starts first."""
    engine = _aged_engine(period=50)
    _submit(engine, "low", priority=5, max_new=2)
    for i in range(5):
        _submit(engine, f"h{i}", priority=0, max_new=HIGH_ANSWER)
    firsts = [e.request_id for e in run_until_idle(engine)
              if isinstance(e, TokenEvent) and e.index == 0]
    assert firsts == ["h0", "h1", "h2", "h3", "h4", "low"]
    assert engine.scheduler.residency.bands.aged == {}


def test_a_band_waiting_behind_its_own_streams_does_not_age() -> None:
    """A backlog of one band, with nothing higher running, waits many periods; a higher
    request then arriving still preempts and starts at once (no head lifted above it)."""
    engine = _aged_engine()
    for i in range(8):
        _submit(engine, f"low{i}", priority=5, max_new=6)
    for _ in range(4 * PERIOD):
        engine.step()
    assert engine.scheduler.residency.aging.passed_over == {5: 0}
    _submit(engine, "high", priority=0, max_new=2)
    events = engine.step() + engine.step()
    assert any(isinstance(e, TokenEvent) and e.request_id == "high" for e in events)
    assert engine.statistics().priority_preemptions == 1
    run_until_idle(engine)
    assert engine.scheduler.residency.bands.aged == {}


def test_the_ttft_estimate_counts_a_head_aging_lifts_ahead_of_it() -> None:
    """A band-5 prompt of 40 tokens waits while band 0 runs: a band-0 newcomer's estimate
    leaves it behind while its band's clock is far from a period, and counts it ahead once
    lifted, or when it will be lifted within the estimate's own steps."""
    engine = _aged_engine(PRIORITY_AGING_STEPS, max_prefill_tokens=32)
    _submit(engine, "h", priority=0, max_new=40)
    engine.step()
    _submit(engine, "low", priority=5, max_new=4, prompt="abcdefghij" * 4)
    engine.step()
    costs = engine.scheduler.costs = StepCosts()  # known costs, not this machine's
    for tokens, ms in ((8, 8.0), (32, 20.0)):
        costs.observe_prefill(tokens, ms)  # 4 ms + 0.5 ms per token
    costs.observe_decode(1, 10.0)
    aging = engine.scheduler.residency.aging

    def estimate(passed_over: int) -> float:
        aging.passed_over[5] = passed_over
        engine._ttft.observe_boundary()
        ms = engine.estimate_ttft_ms(4, priority=0)
        assert ms is not None
        return ms

    period = PRIORITY_AGING_STEPS
    far, lifted, soon = estimate(0), estimate(period), estimate(period - 1)
    assert lifted >= far + 40 * 0.5  # its prompt is prefilled before the newcomer's
    assert soon == pytest.approx(lifted)
    engine.scheduler.residency.aging.passed_over[5] = 0
    run_until_idle(engine)


SAMPLINGS = {
    "greedy": SamplingParams(ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=7, ignore_eos=True),
}


@pytest.mark.parametrize("kind", list(SAMPLINGS))
def test_a_stream_aged_back_in_equals_its_solo_run(
    kind: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    sampling = SAMPLINGS[kind]
    request = GenerationRequest("low", "Every stream has an owner", 12, sampling=sampling,
                                priority=5)
    alone = make_tiny_engine("tiny-llama", max_batch=1, num_blocks=64, block_size=4)
    alone.submit(request)
    solo = tokens_by_request(run_until_idle(alone))["low"]
    engine = make_tiny_engine("tiny-llama", max_batch=1, num_blocks=64, block_size=4)
    engine.scheduler.residency.aging = Aging(6)
    engine.submit(request)
    events = engine.step() + engine.step() + engine.step()  # low runs
    sent = 0
    for _ in range(120):
        if not any(s.request.priority == 0 for s in engine.scheduler.waiting):
            engine.submit(GenerationRequest(f"h{sent}", "The capital of France is", 2,
                                            sampling=SamplingParams(ignore_eos=True)))
            sent += 1
        events += engine.step()
        if any(isinstance(e, FinishEvent) and e.request_id == "low" for e in events):
            break
    assert engine.statistics().priority_preemptions >= 1
    assert engine.scheduler.residency.bands.aged == {5: 1}
    assert tokens_by_request(events)["low"] == solo
