"""A burst of arrivals is prefilled a few prompts per step, never stalling running streams.

``max_prefill_tokens`` bounds the prompt tokens prefilled in one step (at least one
prompt always runs); the rest stay admitted and are prefilled in later steps, in
arrival order, while every running sequence still decodes one token per step.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

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


LONG_PROMPT = "The capital of Italy is Rome. The capital of France is Paris. A stream is an HTTP"


@pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
@pytest.mark.parametrize("budget", [1, 5, 16])
def test_a_prompt_over_the_budget_is_prefilled_in_chunks_with_a_whole_prefills_tokens(
    make_tiny_engine: MakeEngine, model: str, budget: int
) -> None:
    # Chunked prefill (issue 10, section 2): each chunk attends to the cached positions
    # before it; the first token comes after the last chunk, and greedy tokens are the
    # ones a whole-prompt prefill gives.
    def run(max_prefill_tokens: int) -> tuple[list[int], int]:
        """The tokens, and the step (from 1) that gave the first one."""
        engine = make_tiny_engine(model, num_blocks=64, block_size=4,
                                  max_prefill_tokens=max_prefill_tokens)
        engine.submit(GenerationRequest("long", LONG_PROMPT, 8, sampling=FIXED))
        steps = []
        while engine.has_work():
            steps.append([e for e in engine.step() if isinstance(e, TokenEvent)])
        first_step = next(i for i, tokens in enumerate(steps, 1) if tokens)
        return [e.token_id for tokens in steps for e in tokens], first_step

    whole, first_step = run(1000)
    chunked, chunked_first_step = run(budget)
    num_prompt_tokens = len(make_tiny_engine(model).tokenize(LONG_PROMPT))
    assert first_step == 1
    assert chunked_first_step == -(-num_prompt_tokens // budget)  # one step per chunk
    assert chunked == whole
