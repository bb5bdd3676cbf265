"""Priority bands, preemption by priority and fair shares by work (``engine.priority``).

The scheduling decisions are checked on the real Engine over the scripted runner
(``tests.scripted_runner``: letters count up, so every run's text is known); the
identity of a stream preempted for a higher band on the tiny random models, greedy and
seeded: every token equals the same request's run alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from engine import EngineEvent, GenerationRequest, SamplingParams, TokenEvent
from engine.costs import StepCosts
from engine.engine import Engine
from engine.priority import PRIORITY_PREEMPTION_CAP, PRIORITY_PROGRESS_TOKENS, FairShare
from tests.engine_steps import run_until_idle, tokens_by_request
from tests.scripted_runner import scripted_engine


def _submit(engine: Engine, request_id: str, priority: int = 0, max_new: int = 4,
            prompt: str = "abcd", tenant: str = "",
            sampling: SamplingParams | None = None) -> None:
    engine.submit(GenerationRequest(request_id, prompt, max_new, priority=priority,
                                    tenant=tenant, sampling=sampling or SamplingParams()))


def _firsts(engine: Engine) -> list[str]:
    """Step until idle; the request ids in the order their first tokens came."""
    order: list[str] = []
    for event in run_until_idle(engine):
        if isinstance(event, TokenEvent) and event.index == 0:
            order.append(event.request_id)
    return order


def _assert_whole(engine: Engine) -> None:
    engine.step()  # refresh the statistics
    stats = engine.statistics()
    assert (stats.blocks_free, stats.running, stats.waiting) == (stats.blocks_total, 0, 0)
    assert stats.releases == stats.admitted


def test_a_higher_band_is_admitted_before_an_earlier_lower_band() -> None:
    engine = scripted_engine(max_batch=1)
    _submit(engine, "first", priority=0)
    engine.step()  # "first" runs; nobody below its band to preempt for the others
    _submit(engine, "low", priority=2)
    _submit(engine, "mid", priority=1)
    _submit(engine, "high", priority=1)
    engine.step()
    stats = engine.statistics()
    assert stats.waiting_by_band == ((1, 2), (2, 1))
    assert _firsts(engine) == ["mid", "high", "low"]
    assert engine.statistics().priority_preemptions == 0
    _assert_whole(engine)


def test_within_a_band_the_earliest_deadline_goes_first_then_arrival() -> None:
    engine = scripted_engine(max_batch=1)
    _submit(engine, "first")
    engine.step()  # "first" runs: the rest wait, in one band and one tenant
    now = time.monotonic()
    for request_id, deadline, band in [("none", None, 0), ("late", now + 900.0, 0),
                                       ("lower", now + 1.0, 1), ("soon", now + 600.0, 0),
                                       ("none-2", None, 0)]:
        engine.submit(GenerationRequest(request_id, "abcd", 4, priority=band,
                                        ttft_deadline=deadline))
    assert _firsts(engine) == ["soon", "late", "none", "none-2", "lower"]
    _assert_whole(engine)


def test_a_full_batch_preempts_the_lowest_bands_youngest_one_a_step() -> None:
    engine = scripted_engine(max_batch=3)
    _submit(engine, "a", priority=1, max_new=20, prompt="a")
    _submit(engine, "b", priority=2, max_new=20, prompt="a")
    _submit(engine, "c", priority=1, max_new=20, prompt="a")
    events = engine.step()
    assert list(engine.scheduler.running) == ["a", "c", "b"]  # admitted by band
    _submit(engine, "h1", priority=0, max_new=8)
    _submit(engine, "h2", priority=0, max_new=8)
    events += engine.step()  # the lowest band's (2) only one: b
    assert list(engine.scheduler.running) == ["a", "c", "h1"]
    assert engine.statistics().priority_preemptions == 1
    events += engine.step()  # one a step: now band 1's youngest, c
    assert list(engine.scheduler.running) == ["a", "h1", "h2"]
    stats = engine.statistics()
    assert stats.priority_preemptions == 2
    assert stats.preemptions_by_band == ((1, 1), (2, 1))
    tokens = tokens_by_request(events + run_until_idle(engine))
    assert all("".join(map(chr, tokens[r])) == "bcdefghijklmnopqrstu" for r in "bc")
    _assert_whole(engine)


def test_a_stream_preempted_cap_times_is_preempted_again_only_after_progress() -> None:
    """Past the cap, a priority victim again only once it has made
    ``PRIORITY_PROGRESS_TOKENS`` new tokens since its last priority preemption: it keeps
    its slot until then (the floor of progress), and its text is whole at the end."""
    engine = scripted_engine(max_batch=1)
    _submit(engine, "low", priority=5, max_new=24, prompt="a")
    events = engine.step()
    for i in range(PRIORITY_PREEMPTION_CAP):
        while not engine.scheduler.running.get("low"):  # readmitted after the last
            events += engine.step()
        events += engine.step()
        _submit(engine, f"h{i}", priority=0, max_new=2)
        events += engine.step()
        assert "low" not in engine.scheduler.running  # preempted for h{i}
    while not engine.scheduler.running.get("low"):
        events += engine.step()
    low = engine.scheduler.running["low"]
    at_last = low.generated_at_priority_preemption
    _submit(engine, "late", priority=0, max_new=2)
    while len(low.generated_ids) - at_last < PRIORITY_PROGRESS_TOKENS:
        assert list(engine.scheduler.running) == ["low"]  # the floor: it keeps its slot
        events += engine.step()
    events += engine.step()
    assert "late" in engine.scheduler.running  # progress made: a victim again
    assert low.num_priority_preemptions == PRIORITY_PREEMPTION_CAP + 1
    events += run_until_idle(engine)
    tokens = tokens_by_request(events)
    assert "".join(map(chr, tokens["low"])) == "bcdefghijklmnopqrstuvwxyz"[:24]
    assert engine.scheduler.residency.num_priority_preemptions == PRIORITY_PREEMPTION_CAP + 1
    _assert_whole(engine)


def test_two_tenants_in_one_band_share_by_work_not_by_streams() -> None:
    """Tenant "long" asks 16-token prompts for 8 tokens, "short" 2-token prompts for 2,
    submitted alternately (8 and 80). While both have work waiting, the work served to each (prompt
    tokens + 2 per decode token) stays within one long request's of the other's; first
    come first served would serve "long" about 7 times as much."""
    engine = scripted_engine(max_batch=2, max_prefill_tokens=64)
    engine.scheduler.residency.fair = FairShare(decode_weight=2.0)
    for i in range(80):
        if i < 8:
            _submit(engine, f"L{i}", max_new=8, prompt="0123456789abcdef", tenant="long")
        _submit(engine, f"S{i}", max_new=2, prompt="xy", tenant="short")
    served = {"long": 0.0, "short": 0.0}
    most_apart = 0.0
    backlogged = True
    while backlogged:
        events = engine.step()
        backlogged = all(any(s.request.tenant == t for s in engine.scheduler.waiting)
                         for t in served)
        for event in events:
            if isinstance(event, TokenEvent):
                tenant = "long" if event.request_id.startswith("L") else "short"
                served[tenant] += 2 if event.index else (16 if tenant == "long" else 2)
        most_apart = max(most_apart, abs(served["long"] - served["short"]))
    one_long = 16 + 2 * 7
    assert served["short"] > 3 * one_long  # both were served a good while
    assert most_apart <= 2 * one_long
    run_until_idle(engine)
    _assert_whole(engine)


def test_an_idle_tenant_banks_no_credit() -> None:
    engine = scripted_engine(max_batch=1)
    engine.scheduler.residency.fair = FairShare(decode_weight=2.0)
    fair = engine.scheduler.residency.fair
    for i in range(3):
        _submit(engine, f"a{i}", max_new=8, prompt="abcdefgh", tenant="a")
    for _ in range(12):
        engine.step()
    assert fair.counter("a") > 0 and fair.counter("b") == 0
    _submit(engine, "b0", max_new=8, prompt="abcdefgh", tenant="b")
    _submit(engine, "b1", max_new=8, prompt="abcdefgh", tenant="b")
    engine.step()
    # Lifted to the least active counter (then charged if admitted this step): no more.
    assert fair.counter("b") >= fair.counter("a") - 8 - 2 * 8
    firsts = _firsts(engine)
    assert firsts[:2] != ["b0", "b1"] or len(firsts) < 3  # b did not run back to back
    _assert_whole(engine)


def test_fair_share_lifts_a_returning_tenant_and_forgets_when_idle() -> None:
    fair = FairShare(decode_weight=2.0)
    fair.charge("a", prefill_tokens=10, decode_tokens=5)
    assert fair.counter("a") == 20
    fair.arrive("b", {"a"})
    assert fair.counter("b") == 20
    fair.charge("b", decode_tokens=50)
    fair.arrive("b", {"a"})  # a debt is kept: max, not reset
    assert fair.counter("b") == 120
    fair.arrive("c", set())
    assert fair.counters == {}


def test_band_statistics_count_waits_by_band() -> None:
    now = [10.0]
    engine = scripted_engine(max_batch=1, clock=lambda: now[0])
    _submit(engine, "a", priority=0, max_new=2)
    _submit(engine, "b", priority=3, max_new=2)
    engine.step()
    now[0] += 0.5
    run_until_idle(engine)
    waits = dict(engine.statistics().wait_ms_by_band)
    assert waits[0] == 0.0 and waits[3] == pytest.approx(500.0)


MODEL_SAMPLINGS = {
    "greedy": SamplingParams(ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=11, ignore_eos=True),
}
PROMPTS = ["The capital of France is", "A", "Every stream has an owner", "0123", "Rome",
           "tokens leave as they are made"]


@pytest.mark.parametrize("kind", list(MODEL_SAMPLINGS))
def test_streams_preempted_for_a_higher_band_equal_their_solo_runs(
    kind: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    sampling = MODEL_SAMPLINGS[kind]
    flood = [GenerationRequest(f"f{i}", p, 16, sampling=sampling, priority=5, tenant="flood")
             for i, p in enumerate(PROMPTS)]
    urgent = [GenerationRequest(f"u{i}", p, 4, sampling=sampling, priority=0)
              for i, p in enumerate(PROMPTS[:3])]
    solo = {}
    for request in flood + urgent:
        alone = make_tiny_engine("tiny-llama", max_batch=1, num_blocks=64, block_size=4)
        alone.submit(request)
        solo[request.request_id] = tokens_by_request(run_until_idle(alone))[request.request_id]
    engine = make_tiny_engine("tiny-llama", max_batch=4, num_blocks=64, block_size=4)
    for request in flood:
        engine.submit(request)
    events: list[EngineEvent] = []
    for request in urgent:
        events += engine.step() + engine.step()
        engine.submit(request)
    events += run_until_idle(engine)
    assert engine.statistics().priority_preemptions >= 2
    assert tokens_by_request(events) == solo


def test_a_higher_bands_ttft_estimate_has_lower_bands_behind_it_and_preemption_in_view() -> None:
    """Two band-5 streams fill the batch and six band-5 prompts of 40 tokens wait: a
    band-5 newcomer waits for their prefills and for a slot to free (up to 20 decode
    steps); a band-0 newcomer waits for neither, only for one preemption."""
    engine = scripted_engine(max_batch=2, max_prefill_tokens=32)
    for i in range(2):
        _submit(engine, f"run{i}", priority=5, max_new=20, prompt="a")
    engine.step()
    for i in range(6):
        _submit(engine, f"wait{i}", priority=5, max_new=4, prompt="abcdefghij" * 4)
    engine.step()
    engine.step()
    costs = engine.scheduler.costs = StepCosts()  # known costs, not this machine's
    for tokens, ms in ((8, 8.0), (32, 20.0)):
        costs.observe_prefill(tokens, ms)  # 4 ms + 0.5 ms per token
    costs.observe_decode(2, 10.0)
    low = engine.estimate_ttft_ms(4, priority=5)
    high = engine.estimate_ttft_ms(4, priority=0)
    assert low is not None and high is not None
    in_flight = engine.statistics().last_step_ms or 0.0
    # high: its own 4 tokens in one step (10 + 4 + 0.5 * 4 ms) and one preemption's step.
    assert high == pytest.approx(in_flight + 10.0 + (10.0 + 4.0) + 0.5 * 4, rel=0.05)
    assert low > high + 6 * 40 * 0.5 + 10 * 10.0


def test_a_paused_low_band_past_the_cap_lets_the_loop_idle_and_one_under_it_wakes_it() -> None:
    """A higher band waiting behind a full batch of paused sequences: has_work says a step
    would do something only if one of them may still be preempted for it (no spin)."""
    engine = scripted_engine(max_batch=1)
    _submit(engine, "low", priority=5, max_new=20, prompt="a")
    engine.step()
    engine.pause("low")  # its reader is behind: nothing to decode
    low = engine.scheduler.running["low"]
    low.num_priority_preemptions = PRIORITY_PREEMPTION_CAP  # as if preempted twice before
    _submit(engine, "high", priority=0, max_new=2)
    engine.step()
    assert list(engine.scheduler.running) == ["low"] and not engine.has_work()
    low.num_priority_preemptions = 0
    assert engine.has_work()
    engine.step()
    assert list(engine.scheduler.running) == ["high"]
    engine.resume("low")
    run_until_idle(engine)
    _assert_whole(engine)


def test_a_higher_bands_prompt_is_prefilled_first_within_the_step_budget() -> None:
    engine = scripted_engine(max_batch=4, max_prefill_tokens=8)
    _submit(engine, "low", priority=3, max_new=4, prompt="abcdefghijklmnopqrstuvwx")
    engine.step()  # low's first chunk of three
    _submit(engine, "high", priority=0, max_new=4, prompt="abcdefgh")
    for _ in range(3):
        engine.step()
        if "high" in engine.scheduler.running:
            break
    assert engine.statistics().last_step_prefill_ids[0] == "high"
    run_until_idle(engine)
    _assert_whole(engine)
