"""Penalties and logit bias: OpenAI's and vLLM's definitions, per row, identity kept.

``engine.penalties`` changes a row's logits from its own parameters and its own tokens:
the formulas are checked on hand-made logits, and on the tiny random models a penalised
request gives the same tokens concurrent as solo (in a batch of greedy, seeded and
other penalised rows), after a preemption (recomputed) and rebuilt from its tokens
(``resume_from``), as the identity tests do for plain sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine import (
    EngineEvent,
    FinishEvent,
    GenerationRequest,
    InvalidRequest,
    InvalidSampling,
    SamplingParams,
    TokenEvent,
)
from engine.engine import Engine
from engine.penalties import penalize
from engine.precision import PRECISIONS
from tests.engine_steps import run_until_idle

MODELS = pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
PENALISED = {
    "frequency": SamplingParams(frequency_penalty=1.5, ignore_eos=True),
    "presence": SamplingParams(presence_penalty=2.0, ignore_eos=True),
    "repetition": SamplingParams(repetition_penalty=1.8, ignore_eos=True),
    "bias": SamplingParams(logit_bias=((5, 8.0), (17, -100.0), (30, 3.5)), ignore_eos=True),
    "seeded-all": SamplingParams(temperature=0.9, top_p=0.9, seed=5, frequency_penalty=0.7,
                                 presence_penalty=-0.5, repetition_penalty=1.3,
                                 logit_bias=((7, 2.0),), ignore_eos=True),
}
PLAIN = {
    "greedy": SamplingParams(ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, seed=1, ignore_eos=True),
}
PROMPTS = ["The capital of France is", "A", "Every stream has an owner", "0123 0123 0123",
           "Les élèves", "日本語", "Rome", "tokens tokens tokens"]
TOKENS = 20


def _ids(events: list[EngineEvent]) -> dict[str, list[int]]:
    ids: dict[str, list[int]] = {}
    for event in events:
        if isinstance(event, TokenEvent):
            ids.setdefault(event.request_id, []).append(event.token_id)
    return ids


def _requests() -> list[GenerationRequest]:
    kinds = [*PENALISED.items(), *PLAIN.items()]
    return [GenerationRequest(f"{name}-{i}", PROMPTS[i % len(PROMPTS)], TOKENS, sampling=params)
            for i, (name, params) in enumerate(kinds + kinds[:3])]


def _solo(make: Callable[..., Engine], request: GenerationRequest,
          resume_from: list[int] | None = None) -> list[int]:
    engine = make(max_batch=1, num_blocks=64, block_size=4)
    engine.submit(request, resume_from or [])
    return _ids(run_until_idle(engine)).get(request.request_id, [])


# -- the definitions ----------------------------------------------------------------------


def test_frequency_and_presence_follow_openai_over_generated_tokens_only() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    penalize(logits, [(params, [4, 4, 4], [1, 1, 2])])  # the prompt's 4 is not counted
    expected = torch.tensor([[1.0, 2.0 - 2 * 0.5 - 0.25, -1.0 - 0.5 - 0.25, 0.5, 3.0]])
    assert torch.equal(logits, expected)


def test_repetition_divides_positive_and_multiplies_negative_logits_seen_anywhere() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    penalize(logits, [(SamplingParams(repetition_penalty=2.0), [1, 2], [4, 4])])
    assert torch.equal(logits, torch.tensor([[1.0, 1.0, -2.0, 0.5, 1.5]]))


def test_logit_bias_adds_to_its_tokens_before_the_penalties() -> None:
    logits = torch.tensor([[1.0, -2.0, 0.0]])
    params = SamplingParams(logit_bias=((1, 3.0), (2, -100.0)), repetition_penalty=2.0)
    penalize(logits, [(params, [1], [])])
    assert torch.equal(logits, torch.tensor([[1.0, 0.5, -100.0]]))  # (-2 + 3) / 2


def test_rows_without_penalties_are_left_as_they_were() -> None:
    logits = torch.randn(3, 11)
    before = logits.clone()
    penalize(logits, [(SamplingParams(), [1], [2]), (SamplingParams(frequency_penalty=1.0),
                                                     [1], [2]), (SamplingParams(), [], [3])])
    assert torch.equal(logits[[0, 2]], before[[0, 2]])
    assert logits[1, 2] == before[1, 2] - 1.0


def test_a_bfloat16_row_is_changed_in_its_own_dtype_the_same_alone_as_in_a_batch() -> None:
    logits = torch.randn(4, 50).to(torch.bfloat16)
    params = SamplingParams(frequency_penalty=0.3, repetition_penalty=1.1,
                            logit_bias=((3, 0.7),))
    rows = [(SamplingParams(), [], []), (params, [1, 2], [3, 3, 9]),
            (SamplingParams(presence_penalty=1.0), [], [4]), (params, [5], [6])]
    alone = logits[1:2].clone()
    penalize(logits, rows)
    penalize(alone, rows[1:2])
    assert logits.dtype is torch.bfloat16 and torch.equal(logits[1:2], alone)


def test_a_strided_view_of_logits_is_changed_in_place_like_a_contiguous_one() -> None:
    base = torch.randn(3, 2, 11)
    logits = base[:, -1, :]  # the last position of each row, as a forward pass keeps it
    assert not logits.is_contiguous()
    contiguous, before = logits.clone(), logits.clone()
    rows = [(SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5), [1, 2], [2, 3, 3])
            for _ in range(3)]
    penalize(logits, rows)
    penalize(contiguous, rows)
    assert torch.equal(base[:, -1, :], contiguous)
    assert not torch.equal(contiguous, before)


# -- per row on the tiny models ------------------------------------------------------------


@MODELS
@pytest.mark.parametrize("precision", PRECISIONS)
def test_penalised_rows_in_a_mixed_batch_equal_solo(
    model: str, precision: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    requests = _requests()
    engine = make_tiny_engine(model, precision, max_batch=16, num_blocks=128, block_size=4)
    for request in requests:
        engine.submit(request)
    got = _ids(run_until_idle(engine))

    def make(**options: object) -> Engine:
        return make_tiny_engine(model, precision, **options)

    assert got == {r.request_id: _solo(make, r) for r in requests}


@MODELS
def test_penalties_change_the_tokens(model: str, make_tiny_engine: Callable[..., Engine]) -> None:
    # Guards the identity test above against comparing unpenalised runs.
    def make(**options: object) -> Engine:
        return make_tiny_engine(model, **options)

    for params in PENALISED.values():
        plain = SamplingParams(temperature=params.temperature, top_p=params.top_p,
                               seed=params.seed, ignore_eos=True)
        assert any(_solo(make, GenerationRequest("p", prompt, TOKENS, sampling=params))
                   != _solo(make, GenerationRequest("p", prompt, TOKENS, sampling=plain))
                   for prompt in PROMPTS[:4]), params


@MODELS
def test_a_large_logit_bias_makes_its_token_every_greedy_token(
    model: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    def make(**options: object) -> Engine:
        return make_tiny_engine(model, **options)

    params = SamplingParams(logit_bias=((42, 100.0),), ignore_eos=True)
    assert _solo(make, GenerationRequest("b", "Rome", 6, sampling=params)) == [42] * 6


@MODELS
@pytest.mark.parametrize("kind", ["frequency", "repetition", "seeded-all"])
def test_penalised_streams_preempted_mid_stream_equal_solo(
    model: str, kind: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    # Few blocks: sequences lose theirs and recompute; the counts come from their tokens.
    requests = [GenerationRequest(f"r{i}", prompt, 24, sampling=PENALISED[kind])
                for i, prompt in enumerate(PROMPTS)]
    engine = make_tiny_engine(model, max_batch=8, num_blocks=24, block_size=4)
    for request in requests:
        engine.submit(request)
    got = _ids(run_until_idle(engine))
    assert engine.statistics().preemptions >= 3

    def make(**options: object) -> Engine:
        return make_tiny_engine(model, **options)

    assert got == {r.request_id: _solo(make, r) for r in requests}


@MODELS
@pytest.mark.parametrize("kind", ["frequency", "presence", "seeded-all"])
def test_a_penalised_stream_resumed_from_its_tokens_goes_on_as_solo(
    model: str, kind: str, make_tiny_engine: Callable[..., Engine]
) -> None:
    def make(**options: object) -> Engine:
        return make_tiny_engine(model, **options)

    request = GenerationRequest("r", PROMPTS[3], TOKENS, sampling=PENALISED[kind])
    whole = _solo(make, request)
    assert _solo(make, request, resume_from=whole[:9]) == whole[9:]


# -- refused before admission --------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(frequency_penalty=2.5), SamplingParams(presence_penalty=-2.01),
    SamplingParams(presence_penalty=float("nan")), SamplingParams(repetition_penalty=0.0),
    SamplingParams(logit_bias=((1, 100.5),)), SamplingParams(logit_bias=((1, 1.0), (1, 2.0))),
    SamplingParams(logit_bias=tuple((i, 1.0) for i in range(301))),
])
def test_penalties_out_of_range_are_refused(
    params: SamplingParams, make_tiny_engine: Callable[..., Engine]
) -> None:
    engine = make_tiny_engine()
    with pytest.raises(InvalidSampling):
        engine.submit(GenerationRequest("x", "a", 2, sampling=params))
    assert not engine.has_work()


def test_a_logit_bias_token_outside_the_vocabulary_is_refused(
    make_tiny_engine: Callable[..., Engine]
) -> None:
    engine = make_tiny_engine()
    vocab = engine.vocab_size
    assert vocab is not None
    params = SamplingParams(logit_bias=((1, 1.0), (vocab, 1.0)))
    with pytest.raises(InvalidRequest, match="logit_bias"):
        engine.submit(GenerationRequest("x", "a", 2, sampling=params))
    engine.submit(GenerationRequest("y", "a", 2, sampling=SamplingParams(
        logit_bias=((vocab - 1, 1.0),))))
    assert [e.request_id for e in run_until_idle(engine) if isinstance(e, FinishEvent)] == ["y"]
