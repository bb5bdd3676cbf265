"""The priority experiment's measuring parts (``tools/lab/priority.py``), in-process on
tiny-gpt2: Jain's index, and one mixed condition's accounting (interactive TTFTs, the
flood's preempted streams, a whole cache after the drain)."""

from __future__ import annotations

from collections.abc import Callable

from engine import GenerationRequest, SamplingParams
from engine.engine import Engine
from tools.lab.priority import FLEX, INTERACTIVE, Traffic, _jain, _run


def test_jains_index_is_one_for_equal_shares_and_one_over_n_for_one_taker() -> None:
    assert _jain([3.0, 3.0]) == 1.0
    assert _jain([5.0, 0.0]) == 0.5
    assert _jain([]) is None


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

