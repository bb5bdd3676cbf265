"""A stream rebuilt from its tokens so far continues exactly as it would have (issue 11).

``Engine.submit(request, resume_from=ids)`` is what a replica calls when it takes over a
stream whose owner died: the continuation after any k tokens must equal the
uninterrupted run bit for bit (token ids, text deltas, finish), greedy and seeded, on
the tiny random GPT-2 and Llama; a stop string that spans the cut still stops it. The
generator is re-derived by advancing a freshly seeded one past the draws the k tokens
took: ``torch.multinomial`` takes what depends on the vocabulary's size only, which is
checked here against real sampling.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine import (
    EngineEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    InvalidMaxNewTokens,
    SamplingParams,
    TokenEvent,
)
from engine.engine import Engine
from engine.precision import PRECISIONS
from engine.sampling import _sample_row, advance
from tests.scripted_runner import scripted_engine

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=7)
GREEDY = SamplingParams()
TOKENS = 24
MODELS = ["tiny-gpt2", "tiny-llama"]


def _run(engine: Engine, request: GenerationRequest, resume_from: list[int] | None = None,
         max_steps: int = 500) -> list[EngineEvent]:
    engine.submit(request, resume_from or [])
    events: list[EngineEvent] = []
    for _ in range(max_steps):
        if not engine.has_work():
            return [e for e in events if e.request_id == request.request_id]
        events += engine.step()
    raise AssertionError("the engine still has work")


def _tokens(events: list[EngineEvent]) -> list[TokenEvent]:
    return [e for e in events if isinstance(e, TokenEvent)]


def _finish(events: list[EngineEvent]) -> FinishEvent:
    (finish,) = [e for e in events if isinstance(e, FinishEvent)]
    return finish


def _request(request_id: str, sampling: SamplingParams, max_new: int = TOKENS,
             stop: tuple[str, ...] = ()) -> GenerationRequest:
    return GenerationRequest(request_id, "The failover test goes on", max_new, stop=stop,
                             sampling=sampling)


# -- the generator ---------------------------------------------------------------------

def test_multinomial_takes_the_same_from_the_generator_whatever_the_probabilities() -> None:
    vocab = 1000
    peaked = torch.zeros(vocab)
    peaked[3] = 1.0
    sparse = torch.zeros(vocab)
    sparse[:10] = 0.1
    states = []
    for probs in (torch.rand(vocab).softmax(-1), peaked, sparse,
                  torch.rand(vocab, dtype=torch.float64).softmax(-1)):
        generator = torch.Generator().manual_seed(11)
        for _ in range(5):
            torch.multinomial(probs, 1, generator=generator)
        states.append(generator.get_state())
    assert all(torch.equal(states[0], s) for s in states[1:])
    other_size = torch.Generator().manual_seed(11)
    torch.multinomial(torch.rand(vocab + 1).softmax(-1), 1, generator=other_size)
    assert not torch.equal(states[0], other_size.get_state())  # the size does count


@pytest.mark.parametrize("draws", [1, 3, 65, 130])
def test_advance_leaves_the_generator_where_real_sampling_does(draws: int) -> None:
    vocab = 503
    sampled = torch.Generator().manual_seed(5)
    params = [SEEDED, SamplingParams(temperature=1.3, seed=5),
              SamplingParams(temperature=0.5, top_p=0.5, seed=5)]
    for i in range(draws):
        _sample_row(torch.randn(vocab) * 3, params[i % 3], sampled)
    advanced = torch.Generator().manual_seed(5)
    advance(advanced, vocab, draws)
    assert torch.equal(sampled.get_state(), advanced.get_state())


# -- the continuation ------------------------------------------------------------------

@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_continuation_after_k_tokens_equals_the_uninterrupted_run(
    make_tiny_engine: Callable[..., Engine], model: str, sampling: SamplingParams,
    precision: str,
) -> None:
    engine = make_tiny_engine(model, precision, max_batch=4, num_blocks=64, block_size=4)
    whole = _run(engine, _request("whole", sampling))
    ids = [e.token_id for e in _tokens(whole)]
    assert len(ids) == TOKENS and _finish(whole).reason is FinishReason.LENGTH

    for k in (1, 2, 9, TOKENS - 1):
        rest = _run(engine, _request(f"cut-{k}", sampling), ids[:k])
        expected = [TokenEvent(f"cut-{k}", e.index, e.token_id, e.text) for e in _tokens(whole)]
        assert _tokens(rest) == expected[k:], k
        assert _finish(rest) == FinishEvent(f"cut-{k}", FinishReason.LENGTH,
                                            _finish(whole).prompt_tokens, TOKENS)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("model", MODELS)
def test_a_continuation_beside_other_streams_equals_the_uninterrupted_run(
    make_tiny_engine: Callable[..., Engine], model: str, precision: str,
) -> None:
    """Rebuilt in a batch with two other streams, one of them sampled too."""
    engine = make_tiny_engine(model, precision, max_batch=4, num_blocks=64, block_size=4)
    ids = [e.token_id for e in _tokens(_run(engine, _request("whole", SEEDED)))]
    engine.submit(_request("other-1", SEEDED))
    engine.submit(_request("other-2", GREEDY))
    engine.step()
    rest = _run(engine, _request("cut", SEEDED), ids[:5])
    assert [e.token_id for e in _tokens(rest)] == ids[5:]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_stop_string_spanning_the_cut_stops_the_continuation_as_the_whole_run(
    make_tiny_engine: Callable[..., Engine], model: str, sampling: SamplingParams,
) -> None:
    """The stop string's first part is in the tokens before the cut (the stop matcher
    held it back there), its rest in the token after: same events, same finish."""
    engine = make_tiny_engine(model, max_batch=4, num_blocks=64, block_size=4)
    texts = [e.text for e in _tokens(_run(engine, _request("plain", sampling)))]
    full = "".join(texts)
    # A token j whose text starts a new character after a non-empty one: the stop is
    # the previous token's last character and this token's first, found nowhere before.
    cut, stop = next(
        (j, texts[j - 1][-1] + texts[j][0]) for j in range(2, TOKENS)
        if texts[j - 1] and texts[j]
        and full.find(texts[j - 1][-1] + texts[j][0]) == len("".join(texts[:j])) - 1
    )
    whole = _run(engine, _request("whole", sampling, stop=(stop,)))
    assert _finish(whole).reason is FinishReason.STOP
    assert len(_tokens(whole)) == cut + 1
    ids = [e.token_id for e in _tokens(whole)]

    rest = _run(engine, _request("cut", sampling, stop=(stop,)), ids[:cut])
    assert [(e.index, e.token_id, e.text) for e in _tokens(rest)] == [
        (e.index, e.token_id, e.text) for e in _tokens(whole)[cut:]]
    assert _finish(rest).reason is FinishReason.STOP
    assert _finish(rest).completion_tokens == cut + 1
    ended = _run(engine, _request("ended", sampling, stop=(stop,)), ids)  # all, the stop's too
    assert [type(e) for e in ended] == [FinishEvent]
    assert _finish(ended).reason is FinishReason.STOP


def test_tokens_that_already_end_the_stream_give_its_finish_alone(
    make_tiny_engine: Callable[..., Engine],
) -> None:
    """The owner died after its last token, before its finish was logged."""
    engine = make_tiny_engine("tiny-gpt2", max_batch=4, num_blocks=64, block_size=4)
    ids = [e.token_id for e in _tokens(_run(engine, _request("whole", GREEDY, 4)))]
    rest = _run(engine, _request("cut", GREEDY, 4), ids)
    assert rest == [FinishEvent("cut", FinishReason.LENGTH, _finish(rest).prompt_tokens, 4)]
    stats = engine.statistics()
    assert stats.admitted == stats.releases


def test_more_tokens_than_max_new_tokens_are_refused() -> None:
    engine = scripted_engine()
    with pytest.raises(InvalidMaxNewTokens):
        engine.submit(GenerationRequest("r", "abcd", 2), resume_from=[1, 2, 3])
    assert not engine.has_work()


def test_the_scripted_runner_continues_seeded_streams_alike() -> None:
    """The engine's own wiring (replay, advance, recompute) on the scripted runner."""
    engine = scripted_engine()
    sampling = SamplingParams(temperature=1.0, seed=3)
    whole = _run(engine, GenerationRequest("whole", "abcd", 12, sampling=sampling))
    ids = [e.token_id for e in _tokens(whole)]
    for k in (1, 6, 11):
        rest = _run(engine, GenerationRequest(f"cut-{k}", "abcd", 12, sampling=sampling),
                    ids[:k])
        assert [(e.index, e.token_id, e.text) for e in _tokens(rest)] == [
            (e.index, e.token_id, e.text) for e in _tokens(whole)[k:]]


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
@pytest.mark.parametrize("model", MODELS)
def test_a_continuation_has_the_uninterrupted_runs_logprobs_bit_for_bit(
    make_tiny_engine: Callable[..., Engine], model: str, precision: str,
) -> None:
    """The recomputed positions' keys and values are the ones the decode steps made: each
    later token's log-probabilities are the uninterrupted run's, not just its argmax.
    (float32's products take another path for one row than for many, so its last bits
    may differ: its tokens are checked above.)"""
    sampling = SamplingParams(logprobs=True, top_logprobs=3)
    engine = make_tiny_engine(model, precision, max_batch=4, num_blocks=64, block_size=4)
    whole = _tokens(_run(engine, _request("whole", sampling)))
    for k in (1, 9, TOKENS - 1):
        cut = [e.token_id for e in whole[:k]]
        rest = _tokens(_run(engine, _request(f"cut-{k}", sampling), cut))
        assert [e.logprobs for e in rest] == [e.logprobs for e in whole[k:]], k
