"""Per-token log-probabilities: the library's numbers, independent of batch mates, paid
only by the rows that ask; and which stop string ended a run.

Tolerance. Concurrent equals solo for the token ids exactly (float32 on the CPU, as in
``test_engine_identity``); the log-probabilities of a concurrent run agree with the solo
run's within ``LOGPROB_TOLERANCE`` (absolute, natural log): a batched forward pass may
round the logits differently in the last bits, nothing more. Against the library's own
forward pass (sdpa attention, no cache) the same tolerance holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from engine import (
    MAX_TOP_LOGPROBS,
    EngineEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    InvalidSampling,
    SamplingParams,
    TokenEvent,
    validate_sampling,
)
from engine import sampling as sampling_module
from engine.engine import Engine
from engine.logprobs import MIN_LOGPROB, TokenTexts
from engine.model import LoadedModel, load_model
from engine.text import StopMatcher
from tests.test_engine_identity import CASES, ENGINE_OPTIONS, GREEDY, MODELS, SEEDED

LOGPROB_TOLERANCE = 1e-4
TOP = 5
ASKING = SamplingParams(ignore_eos=True, logprobs=True, top_logprobs=TOP)

MakeEngine = Callable[..., Engine]


def _asking(params: SamplingParams, top: int = TOP) -> SamplingParams:
    return SamplingParams(params.temperature, params.top_p, params.top_k, params.seed,
                          params.ignore_eos, logprobs=True, top_logprobs=top)


def _run(engine: Engine, requests: list[GenerationRequest]) -> dict[str, list[TokenEvent]]:
    for request in requests:
        engine.submit(request)
    events: list[EngineEvent] = []
    while engine.has_work():
        events += engine.step()
    tokens: dict[str, list[TokenEvent]] = {r.request_id: [] for r in requests}
    for event in events:
        if isinstance(event, TokenEvent):
            tokens[event.request_id].append(event)
    return tokens


def _assert_close(got: list[TokenEvent], expected: list[TokenEvent]) -> None:
    assert [t.token_id for t in got] == [t.token_id for t in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.logprobs is not None and theirs.logprobs is not None
        assert mine.logprobs.token == theirs.logprobs.token
        assert abs(mine.logprobs.logprob - theirs.logprobs.logprob) <= LOGPROB_TOLERANCE
        assert len(mine.logprobs.top) == len(theirs.logprobs.top)
        # The values agree in order; ids may swap only between values within tolerance.
        for (i, _, a), (j, _, b) in zip(mine.logprobs.top, theirs.logprobs.top, strict=True):
            assert abs(a - b) <= LOGPROB_TOLERANCE
            assert i == j or abs(a - b) <= LOGPROB_TOLERANCE


@MODELS
def test_concurrent_logprobs_equal_solo_within_tolerance(
    model: str, make_tiny_engine: MakeEngine, tiny_model: Callable[[str], LoadedModel]
) -> None:
    requests = [GenerationRequest(f"g{i}", p, n, sampling=ASKING)
                for i, (p, n) in enumerate(CASES[:8])]
    requests += [GenerationRequest(f"s{i}", p, n + 4, sampling=_asking(params))
                 for i, ((p, n), params) in enumerate(zip(CASES[8:], SEEDED, strict=False))]
    together = _run(make_tiny_engine(model, **ENGINE_OPTIONS), requests)

    for request in requests:
        alone = _run(Engine(tiny_model(model), **ENGINE_OPTIONS), [request])
        _assert_close(together[request.request_id], alone[request.request_id])


@MODELS
def test_asking_for_logprobs_changes_no_token_and_others_get_none(
    model: str, make_tiny_engine: MakeEngine
) -> None:
    def requests(ask: bool) -> list[GenerationRequest]:
        made = []
        for i, ((prompt, n), params) in enumerate(zip(CASES, [*SEEDED, *[GREEDY] * 4],
                                                      strict=False)):
            wants = ask and i % 2 == 0
            made.append(GenerationRequest(f"r{i}", prompt, n + 3,
                                          sampling=_asking(params) if wants else params))
        return made

    plain = _run(make_tiny_engine(model, **ENGINE_OPTIONS), requests(False))
    mixed = _run(make_tiny_engine(model, **ENGINE_OPTIONS), requests(True))

    assert {k: [t.token_id for t in v] for k, v in mixed.items()} == {
        k: [t.token_id for t in v] for k, v in plain.items()}
    for i, request_id in enumerate(mixed):
        assert all((t.logprobs is not None) == (i % 2 == 0) for t in mixed[request_id])
    assert all(t.logprobs is None for tokens in plain.values() for t in tokens)


@MODELS
@pytest.mark.parametrize("params", [ASKING, _asking(SEEDED[0]), _asking(SEEDED[1])],
                         ids=["greedy", "temperature-0.8-top-p", "temperature-1.3-top-k"])
def test_first_token_logprobs_are_the_librarys_after_temperature(
    model: str, params: SamplingParams, make_tiny_engine: MakeEngine
) -> None:
    reference = load_model(model, "cpu")
    reference.model.set_attn_implementation("sdpa")
    texts = TokenTexts(reference.tokenizer)
    engine = make_tiny_engine(model, **ENGINE_OPTIONS)
    for prompt, _ in CASES[:6]:
        ids = reference.tokenizer.encode(prompt)
        with torch.inference_mode():
            logits = reference.model(torch.tensor([ids])).logits[0, -1].float()
        temperature = params.temperature or 1.0  # greedy: the logits themselves
        expected = torch.log_softmax(logits / temperature, dim=-1)

        first = _run(engine, [GenerationRequest(prompt, prompt, 1, sampling=params)])[prompt][0]

        assert first.logprobs is not None
        assert first.logprobs.token == texts(first.token_id)
        assert abs(first.logprobs.logprob - expected[first.token_id].item()) <= LOGPROB_TOLERANCE
        values = [v for _, _, v in first.logprobs.top]
        assert len(values) == TOP and values == sorted(values, reverse=True)
        want = expected.topk(TOP)
        assert [round(v, 3) for v in values] == [round(v, 3) for v in want.values.tolist()]
        assert all(text == texts(i) for i, text, _ in first.logprobs.top)
        if params.temperature == 0:  # the greedy token is the likeliest
            assert first.logprobs.top[0][0] == first.token_id


def test_each_row_gets_its_own_number_of_top_logprobs(make_tiny_engine: MakeEngine) -> None:
    requests = [GenerationRequest(f"r{k}", "The capital of France is", 3,
                                  sampling=_asking(ASKING, top=k))
                for k in (0, 1, 7, MAX_TOP_LOGPROBS)]
    got = _run(make_tiny_engine(**ENGINE_OPTIONS), requests)

    for k, request in zip((0, 1, 7, MAX_TOP_LOGPROBS), requests, strict=True):
        lists = [t.logprobs.top for t in got[request.request_id] if t.logprobs is not None]
        assert [len(top) for top in lists] == [k] * 3


def test_a_ruled_out_token_is_reported_at_the_floor() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 1.0], [2.0, 0.0, float("-inf")]])
    rows = [(SamplingParams(logprobs=True, top_logprobs=3), None)] * 2

    outcomes = sampling_module.sample(logits, rows)

    tops = [o.top for o in outcomes if isinstance(o, sampling_module.Sampled)]
    assert [[i for i, _ in top] for top in tops] == [[2, 0, 1], [0, 1, 2]]
    assert tops[0][2][1] == tops[1][2][1] == MIN_LOGPROB
    assert all(math.isfinite(v) for top in tops for _, v in top)


@pytest.mark.parametrize("params", [
    SamplingParams(top_logprobs=1),  # without logprobs
    SamplingParams(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS + 1),
    SamplingParams(logprobs=True, top_logprobs=-1),
    SamplingParams(logprobs=True, top_logprobs=True),  # type: ignore[arg-type]
    SamplingParams(logprobs=1),  # type: ignore[arg-type]
])
def test_out_of_range_logprobs_are_refused(params: SamplingParams) -> None:
    with pytest.raises(InvalidSampling):
        validate_sampling(params)


# -- which stop string ended a run ------------------------------------------------------


def test_stop_matcher_names_the_stop_that_matched() -> None:
    matcher = StopMatcher(("zz", "lo w", "o"))
    assert matcher.feed("he") == ("he", False) and matcher.matched is None
    assert matcher.feed("llo world") == ("l", True)
    assert matcher.matched == "lo w"  # it begins before "o"


def test_stop_matcher_of_two_stops_at_one_place_names_the_shorter() -> None:
    matcher = StopMatcher(("abc", "ab"))
    assert matcher.feed("xabcd") == ("x", True)
    assert matcher.matched == "ab"


@pytest.mark.parametrize("mode", ["at-once", "across-the-last-token"])
def test_finish_event_names_the_stop_string(mode: str, make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine(**ENGINE_OPTIONS)
    plain = _run(engine, [GenerationRequest("p", "The capital of France is", 8,
                                            sampling=SamplingParams(ignore_eos=True))])
    text = "".join(t.text for t in plain["p"])
    stop = text[3:5] if mode == "at-once" else text[-2:]
    engine.submit(GenerationRequest("s", "The capital of France is", 8,
                                    stop=("\u2603", stop, "\u2604"),
                                    sampling=SamplingParams(ignore_eos=True)))
    events: list[EngineEvent] = []
    while engine.has_work():
        events += engine.step()

    finish = events[-1]
    assert isinstance(finish, FinishEvent)
    assert (finish.reason, finish.stop_sequence) == (FinishReason.STOP, stop)


def test_a_finish_other_than_stop_names_no_stop_string(make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine(**ENGINE_OPTIONS)
    engine.submit(GenerationRequest("r", "Hi", 2, stop=("\u2603",),
                                    sampling=SamplingParams(ignore_eos=True)))
    events: list[EngineEvent] = []
    while engine.has_work():
        events += engine.step()

    assert isinstance(events[-1], FinishEvent)
    assert (events[-1].reason, events[-1].stop_sequence) == (FinishReason.LENGTH, None)
