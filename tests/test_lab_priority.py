"""The priority experiment's measuring parts (``tools/lab/priority.py``), in-process on
tiny-gpt2: Jain's index, and one mixed condition's accounting (interactive TTFTs, the
flood's preempted streams, a whole cache after the drain)."""

from __future__ import annotations

from collections.abc import Callable

from engine import GenerationRequest, SamplingParams
from engine.aging import Aging
from engine.engine import Engine
from tools.lab.priority import FLEX, INTERACTIVE, Outcome, Traffic, _jain, _rate_over, _run


def test_jains_index_is_one_for_equal_shares_and_one_over_n_for_one_taker() -> None:
    assert _jain([3.0, 3.0]) == 1.0
    assert _jain([5.0, 0.0]) == 0.5
    assert _jain([]) is None


def test_the_flood_alone_is_compared_over_the_same_steps_as_the_quiet_ones() -> None:
    alone = Outcome(flood_steps=[(1, 1.0), (8, 1.0), (8, 1.0), (2, 1.0)])
    assert _rate_over(alone, [0, 3]) == 1.5  # the first step and the last, not the middle
    assert _rate_over(alone, [9]) is None


def test_a_mixed_condition_counts_interactive_times_preemptions_and_no_leak(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    greedy = SamplingParams(ignore_eos=True)
    flood = [GenerationRequest(f"flood{i}", "a long flood prompt " * 4, 24, sampling=greedy,
                               priority=FLEX, tenant="flood") for i in range(12)]
    interactive = [(4 + 6 * k, GenerationRequest(f"int{k}", "hello", 4, sampling=greedy,
                                                 priority=INTERACTIVE)) for k in range(3)]
    engine = make_tiny_engine("tiny-gpt2", max_batch=3, num_blocks=256, block_size=4)
    out = _run(engine, Traffic(interactive=interactive, loops={"flood": (5, flood)}), 30)
    assert len(out.ttft) == 3 and len(out.gaps) == 9
    assert out.priority_preemptions >= 1 and out.preempted
    assert out.quiet_s > 0 and out.flood_tokens_quiet > 0
    assert out.leaked_blocks == 0
    for rid in sorted(out.preempted):
        alone = make_tiny_engine("tiny-gpt2", max_batch=1, num_blocks=256, block_size=4)
        solo = _run(alone, Traffic(interactive=[(0, out.requests[rid])]), 0)
        if rid in out.finished:
            assert out.texts[rid] == solo.texts[rid]
        else:  # cancelled at the end of the condition: a prefix of its solo text
            assert solo.texts[rid].startswith(out.texts.get(rid, ""))



def test_a_starved_condition_measures_the_low_bands_longest_wait_in_steps(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    """The interactive band keeps more streams than the batch holds; the flex stream's
    wait in steps is measured, and aging admits it within a period and an answer."""
    greedy = SamplingParams(ignore_eos=True)
    high = [GenerationRequest(f"high{i}", "hello", 4, sampling=greedy, priority=INTERACTIVE)
            for i in range(80)]
    low = GenerationRequest("low0", "a flex prompt", 6, sampling=greedy, priority=FLEX)
    engine = make_tiny_engine("tiny-gpt2", max_batch=2, num_blocks=256, block_size=4)
    engine.scheduler.residency.aging = Aging(8)
    out = _run(engine, Traffic(interactive=[(0, low)], loops={"high": (4, high)}), 30)
    assert len(out.ttft) == 1  # admitted within the condition
    assert 8 - 1 <= out.longest_wait_steps[FLEX] <= 8 + 4  # lifted at its 8th step
    assert out.leaked_blocks == 0
