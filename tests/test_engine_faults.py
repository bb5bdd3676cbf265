"""Faults stay with their sequence, and no event is lost whatever raises.

A failure tied to one sequence (its sampler, its detokenizer, its stop matcher) ends
that sequence alone with FinishReason.ERROR and a message; the others in the batch go
on exactly as in a run without the fault. A raising ``on_prefill`` loses no event: each
request still gets exactly one FinishEvent. The faults are injected into one Sequence
object of a real engine on the tiny model (the engine's internals, as tests may use).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from engine import (
    EngineEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from engine.engine import Engine
from engine.sequence import Sequence
from engine.text import IncrementalDetokenizer
from tests.engine_steps import run_until_idle

MakeEngine = Callable[..., Engine]
FIXED = SamplingParams(ignore_eos=True)  # lengths do not depend on the random model's eos
SEEDED = SamplingParams(temperature=0.8, seed=7, ignore_eos=True)
PROMPTS = ["The capital of France is", "A", "Every stream", "日本語のテキスト"]
MAX_NEW = 6
IDS = [f"r{i}" for i in range(8)]
VICTIM = "r3"


class InjectedFault(RuntimeError):
    pass


class FaultyDetokenizer:
    """Wraps a sequence's detokenizer; raises at its ``fail_at``-th ``add`` (0-based),
    or at ``flush`` when ``fail_at`` is None."""

    def __init__(self, inner: IncrementalDetokenizer, fail_at: int | None) -> None:
        self._inner = inner
        self._fail_at = fail_at
        self._adds = 0

    def add(self, token_id: int) -> str:
        if self._adds == self._fail_at:
            raise InjectedFault(f"bad token {token_id}")
        self._adds += 1
        return self._inner.add(token_id)

    def flush(self) -> str:
        if self._fail_at is None:
            raise InjectedFault("bad flush")
        return self._inner.flush()


def _requests(victim_sampling: SamplingParams = FIXED) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            rid, PROMPTS[i % len(PROMPTS)], MAX_NEW,
            sampling=victim_sampling if rid == VICTIM else FIXED,
        )
        for i, rid in enumerate(IDS)
    ]


def _queued(engine: Engine, request_id: str) -> Sequence:
    """The Sequence a submit put in the inbox (before the step that applies it)."""
    return next(s for s in engine.scheduler.inbox.pending() if isinstance(s, Sequence)
                and s.request_id == request_id)


def _tokens(events: list[EngineEvent], request_id: str) -> list[int]:
    return [e.token_id for e in events if isinstance(e, TokenEvent) and e.request_id == request_id]


def _finishes(events: list[EngineEvent]) -> dict[str, list[FinishEvent]]:
    result: dict[str, list[FinishEvent]] = {}
    for event in events:
        if isinstance(event, FinishEvent):
            result.setdefault(event.request_id, []).append(event)
    return result


def _run_eight(
    make_tiny_engine: MakeEngine,
    requests: list[GenerationRequest],
    inject: Callable[[Sequence], None] | None = None,
    inject_after_steps: int = 0,
) -> tuple[Engine, list[EngineEvent]]:
    """Run eight requests in one batch to their end; inject a fault into VICTIM's
    Sequence after ``inject_after_steps`` steps (0: before its first step)."""
    engine = make_tiny_engine(max_batch=8, num_blocks=64, block_size=8)
    for request in requests:
        engine.submit(request)
    events: list[EngineEvent] = []
    if inject is not None and inject_after_steps == 0:
        inject(_queued(engine, VICTIM))
    elif inject is not None:
        for _ in range(inject_after_steps):
            events += engine.step()
        inject(engine.scheduler.running[VICTIM])
    return engine, events + run_until_idle(engine)


@pytest.mark.parametrize(
    ("fail_at", "tokens_before"),
    [(0, 0), (3, 3), (None, MAX_NEW - 1)],
    ids=["first-token", "mid-stream", "final-flush"],
)
def test_a_detokenizer_fault_ends_only_its_sequence(
    make_tiny_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch,
    fail_at: int | None, tokens_before: int,
) -> None:
    _, reference = _run_eight(make_tiny_engine, _requests())

    def inject(seq: Sequence) -> None:
        monkeypatch.setattr(seq, "detokenizer", FaultyDetokenizer(seq.detokenizer, fail_at))

    engine, events = _run_eight(make_tiny_engine, _requests(), inject)

    _assert_only_the_victim_failed(engine, events, reference, tokens_before, "InjectedFault")


def test_a_sampler_fault_mid_stream_ends_only_its_sequence(
    make_tiny_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, reference = _run_eight(make_tiny_engine, _requests(SEEDED))

    def inject(seq: Sequence) -> None:
        monkeypatch.setattr(seq, "generator", "not a generator")  # torch.multinomial raises

    # Three steps: the prefill's token and two decoded; the fault hits the batch's 4th.
    engine, events = _run_eight(make_tiny_engine, _requests(SEEDED), inject, 3)

    _assert_only_the_victim_failed(engine, events, reference, 3, "TypeError")


def _assert_only_the_victim_failed(
    engine: Engine, events: list[EngineEvent], reference: list[EngineEvent],
    tokens_before: int, error_name: str,
) -> None:
    finishes = _finishes(events)
    assert sorted(finishes) == IDS
    assert all(len(f) == 1 for f in finishes.values())  # exactly one FinishEvent each
    for rid in IDS:
        if rid != VICTIM:
            assert _tokens(events, rid) == _tokens(reference, rid)
            assert finishes[rid][0].reason is FinishReason.LENGTH
    victim = finishes[VICTIM][0]
    assert victim.reason is FinishReason.ERROR
    assert victim.error is not None
    assert f"token {tokens_before} failed: {error_name}" in victim.error
    assert _tokens(events, VICTIM) == _tokens(reference, VICTIM)[:tokens_before]
    assert victim.completion_tokens == tokens_before
    stats = engine.statistics()
    assert (stats.releases, stats.admitted) == (8, 8)
    assert stats.blocks_free == stats.blocks_total


# -- on_prefill raises: nothing is lost ----------------------------------------------------


@pytest.mark.parametrize("raise_at_call", [0, 1])
def test_raising_on_prefill_loses_no_event(
    make_tiny_engine: MakeEngine, raise_at_call: int
) -> None:
    engine = make_tiny_engine(max_batch=2, num_blocks=64, block_size=8)
    for rid in ("a", "b", "w"):  # w waits for a slot
        engine.submit(GenerationRequest(rid, PROMPTS[0], 4, sampling=FIXED))
    events = engine.step()  # a and b prefilled
    engine.submit(GenerationRequest("c", PROMPTS[1], 4, sampling=FIXED))
    engine.cancel("a")  # running: frees a slot, so w is admitted and prefilled this step
    engine.cancel("c")  # waiting (queued behind w): finishes without a token
    handed: list[list[EngineEvent]] = []

    def on_prefill(batch: list[EngineEvent]) -> None:
        handed.append(batch)
        if len(handed) - 1 == raise_at_call:
            raise InjectedFault("the event loop is gone")

    stepped: list[EngineEvent] = []
    try:
        stepped = engine.step(on_prefill=on_prefill)
    except InjectedFault:
        pass
    else:
        assert raise_at_call >= len(handed), "on_prefill raised but step() returned"
    for batch in handed:
        events += batch
    events += stepped + run_until_idle(engine)

    finishes = _finishes(events)
    assert {rid: [f.reason for f in fs] for rid, fs in finishes.items()} == {
        "a": [FinishReason.CANCELLED],
        "b": [FinishReason.LENGTH],
        "c": [FinishReason.CANCELLED],
        "w": [FinishReason.LENGTH],
    }
    tokens = Counter((e.request_id, e.index) for e in events if isinstance(e, TokenEvent))
    assert all(count == 1 for count in tokens.values())  # no token twice
    for rid in ("b", "w"):
        assert sorted(i for r, i in tokens if r == rid) == [0, 1, 2, 3]
    stats = engine.statistics()
    assert stats.releases == stats.admitted == 3


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-6])
def test_a_vanishing_temperature_is_greedy_not_a_failure(
    make_tiny_engine: MakeEngine, temperature: float
) -> None:
    # Found by the HTTP fuzz test: logits / 1e-300 overflow to inf and the softmax to
    # NaN, so the draw raised and /v1/generate answered 500.
    tiny = SamplingParams(temperature=temperature, seed=1, ignore_eos=True)
    _, greedy_run = _run_eight(make_tiny_engine, _requests())
    _, tiny_run = _run_eight(make_tiny_engine, _requests(victim_sampling=tiny))

    assert [f.reason for f in _finishes(tiny_run)[VICTIM]] == [FinishReason.LENGTH]
    assert _tokens(tiny_run, VICTIM) == _tokens(greedy_run, VICTIM)


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-9])
def test_a_vanishing_top_p_keeps_the_likeliest_token(
    make_tiny_engine: MakeEngine, top_p: float
) -> None:
    # Found by the HTTP fuzz test: top_p rounds to 0.0 in float32, every token was
    # dropped, and the draw from an all -inf row raised (a 500 on /v1/completions).
    nucleus = SamplingParams(temperature=1.0, top_p=top_p, seed=1, ignore_eos=True)
    _, greedy_run = _run_eight(make_tiny_engine, _requests())
    _, nucleus_run = _run_eight(make_tiny_engine, _requests(victim_sampling=nucleus))

    assert [f.reason for f in _finishes(nucleus_run)[VICTIM]] == [FinishReason.LENGTH]
    assert _tokens(nucleus_run, VICTIM) == _tokens(greedy_run, VICTIM)
