"""Prefix caching gives the tokens the cache-off engine gives (tiny GPT-2 and Llama).

Each scenario runs twice on fresh engines, with ``prefix_cache`` off and on, and the
token ids of every request must be identical; the cache-on run must also have found
what the scenario shares (its hit counters), so these tests fail without the feature.
Prompts are token ids (``prompt_token_ids``) so that what they share is exact: a
block is 4 positions, so sharing is counted in blocks of 4 tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from engine import EngineEvent, FinishEvent, GenerationRequest, SamplingParams
from engine.engine import Engine

MODELS = pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])
GREEDY = SamplingParams(ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
OPTIONS = {"max_batch": 8, "num_blocks": 96, "block_size": 4}

_rng = random.Random(26)
BASE = [_rng.randrange(1, 384) for _ in range(40)]  # the shared "system prompt"
OTHER = [_rng.randrange(1, 384) for _ in range(40)]

MakeEngine = Callable[..., Engine]


def _request(rid: str, ids: list[int], max_new: int = 6,
             sampling: SamplingParams = GREEDY) -> GenerationRequest:
    return GenerationRequest(rid, "", max_new, sampling=sampling, prompt_token_ids=tuple(ids))


def _drain(engine: Engine, events: list[EngineEvent]) -> None:
    for _ in range(1000):
        if not engine.has_work():
            return
        events += engine.step()
    raise AssertionError("still working after 1000 steps")


def _ids(events: list[EngineEvent]) -> dict[str, list[int]]:
    ids: dict[str, list[int]] = {}
    for event in events:
        if not isinstance(event, FinishEvent):
            ids.setdefault(event.request_id, []).append(event.token_id)
    return ids


Scenario = Callable[[Engine], list[EngineEvent]]


def _both(make: MakeEngine, model: str, scenario: Scenario, **options: object
          ) -> tuple[dict[str, list[int]], dict[str, list[int]], Engine]:
    """The scenario's ids with the cache off and on, and the cache-on engine."""
    off = make(model, **{**OPTIONS, **options})
    on = make(model, **{**OPTIONS, **options}, prefix_cache=True)
    got_off, got_on = _ids(scenario(off)), _ids(scenario(on))
    on.allocator.check()
    assert off.statistics().prefix_cache_queries == 0  # off: nothing looked up
    return got_off, got_on, on


def _waves(*waves: list[GenerationRequest]) -> Scenario:
    """Each wave submitted at once, then run until idle (so the next finds it cached)."""
    def run(engine: Engine) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        for wave in waves:
            for request in wave:
                engine.submit(request)
            _drain(engine, events)
        return events
    return run


def _sharing(sampling: SamplingParams) -> Scenario:
    first = [_request("a", BASE[:22], sampling=sampling)]
    second = [
        _request("all", BASE[:22], sampling=sampling),  # every full block, the same prompt
        _request("some", BASE[:13] + OTHER[:9], sampling=sampling),  # 3 full blocks shared
        _request("none", OTHER[:17], sampling=sampling),  # nothing shared
        _request("prefix", BASE[:8], sampling=sampling),  # a prefix of a, block-aligned
        _request("prefix-odd", BASE[:10], sampling=sampling),  # a prefix of a, mid-block
        _request("longer", BASE[:40], sampling=sampling),  # a is a prefix of it
    ]
    return _waves(first, second)


@MODELS
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_shared_prompts_give_the_tokens_of_the_cache_off(
    model: str, sampling: SamplingParams, make_tiny_engine: MakeEngine
) -> None:
    off, on, engine = _both(make_tiny_engine, model, _sharing(sampling))
    assert on == off and len(on) == 7
    stats = engine.statistics()
    # all: 5 blocks (never the last position: 21 // 4), some: 3, prefix: 1 (7 // 4),
    # prefix-odd: 2, longer: 5 (a's 22 positions hold 5 full blocks).
    assert stats.prefix_cache_hits == 4 * (5 + 3 + 1 + 2 + 5)
    assert stats.prefix_cache_queries == 22 + 22 + 22 + 17 + 8 + 10 + 40


def _cached(events: list[EngineEvent]) -> dict[str, int]:
    return {e.request_id: e.cached_tokens for e in events if isinstance(e, FinishEvent)}


@MODELS
def test_each_finish_reports_the_prompt_tokens_found_cached(
    model: str, make_tiny_engine: MakeEngine
) -> None:
    # What usage reports as cached_tokens: per request, the hits counted above
    on = make_tiny_engine(model, **OPTIONS, prefix_cache=True)
    assert _cached(_sharing(GREEDY)(on)) == {"a": 0, "all": 20, "some": 12, "none": 0,
                                             "prefix": 4, "prefix-odd": 8, "longer": 20}
    off = make_tiny_engine(model, **OPTIONS)
    assert set(_cached(_sharing(GREEDY)(off)).values()) == {0}


@MODELS
def test_a_conversation_reuses_its_history_and_answers(
    model: str, make_tiny_engine: MakeEngine
) -> None:
    # Turn 2 re-sends turn 1's prompt and its answer (its decoded blocks are cached too).
    def run(engine: Engine) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        engine.submit(_request("t1", BASE[:18], max_new=9))
        _drain(engine, events)
        history = BASE[:18] + _ids(events)["t1"] + OTHER[:5]
        engine.submit(_request("t2", history, max_new=7))
        _drain(engine, events)
        return events
    off, on, engine = _both(make_tiny_engine, model, run)
    assert on == off
    assert engine.statistics().prefix_cache_hits == 4 * 6  # 26 positions of t1 written


@MODELS
def test_identical_prompts_at_once_and_while_others_decode(
    model: str, make_tiny_engine: MakeEngine
) -> None:
    # Two identical prompts submitted together: y waits while x computes the blocks it
    # would share, then finds them cached; joiners find them while they decode.
    def run(engine: Engine) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        engine.submit(_request("x", BASE[:21], max_new=12))
        engine.submit(_request("y", BASE[:21], max_new=12))
        for _ in range(3):
            events += engine.step()
        engine.submit(_request("z", BASE[:21] + OTHER[:3], max_new=5))
        engine.submit(_request("w", BASE[:16], max_new=5, sampling=SEEDED))
        _drain(engine, events)
        return events
    off, on, engine = _both(make_tiny_engine, model, run)
    assert on == off
    assert engine.statistics().prefix_cache_hits == 4 * (5 + 5 + 3)


@MODELS
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_burst_with_one_system_prompt_computes_it_once(
    model: str, sampling: SamplingParams, make_tiny_engine: MakeEngine
) -> None:
    # Eight prompts at once, each BASE[:33] then its own 3 tokens, a budget that would
    # prefill them all in one step: the first computes the 8 full blocks of BASE, the
    # others wait for them, then share them (the mixed blocks past 32 are each its own).
    def run(engine: Engine) -> list[EngineEvent]:
        return _waves([_request(f"b{i}", BASE[:33] + OTHER[3 * i:3 * i + 3], max_new=5,
                                sampling=sampling) for i in range(8)])(engine)
    off, on, engine = _both(make_tiny_engine, model, run, max_prefill_tokens=512)
    assert on == off and len(on) == 8
    stats = engine.statistics()
    assert stats.prefix_cache_hits == 7 * 4 * 8
    assert stats.prefix_cache_queries - stats.prefix_cache_hits == 36 + 7 * 4


@MODELS
def test_a_cached_prefix_evicted_mid_run(model: str, make_tiny_engine: MakeEngine) -> None:
    # 24 blocks: a's blocks are evicted for the others while they run; a again afterwards
    # finds nothing (or what was left) and computes it again, with the same tokens.
    def run(engine: Engine) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        engine.submit(_request("a", BASE[:24], max_new=4))
        _drain(engine, events)
        for i in range(3):
            engine.submit(_request(f"o{i}", OTHER[i:i + 24], max_new=8))
        for _ in range(4):
            events += engine.step()
        engine.submit(_request("a2", BASE[:24], max_new=4))
        engine.submit(_request("b", BASE[:12] + OTHER[:6], max_new=4))
        _drain(engine, events)
        return events
    off, on, engine = _both(make_tiny_engine, model, run, num_blocks=24, max_batch=4)
    assert on == off
    assert engine.statistics().blocks_evicted > 0


@MODELS
def test_preemption_recomputes_from_what_is_still_cached(
    model: str, make_tiny_engine: MakeEngine
) -> None:
    # A pool too small for all to decode to the end: preemptions by recompute, whose
    # readmissions find their own committed blocks (and the shared prefix).
    def run(engine: Engine) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        for i in range(5):
            engine.submit(_request(f"p{i}", BASE[:12] + OTHER[i:i + 3], max_new=20))
        _drain(engine, events)
        return events
    off, on, engine = _both(make_tiny_engine, model, run, num_blocks=26, watermark=0.0)
    assert on == off and len(on) == 5
    stats = engine.statistics()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.recomputed_tokens < off_recomputed(make_tiny_engine, model, run)
    # a readmission finds its own blocks again; its usage keeps what its first found
    preempted = make_tiny_engine(model, **{**OPTIONS, "num_blocks": 26, "watermark": 0.0},
                                 prefix_cache=True)
    assert set(_cached(run(preempted)).values()) <= {0, 12}


def off_recomputed(make: MakeEngine, model: str, run: Scenario) -> int:
    engine = make(model, **{**OPTIONS, "num_blocks": 26, "watermark": 0.0})
    run(engine)
    return engine.statistics().recomputed_tokens


@MODELS
def test_cancelled_holders_leave_the_shared_prefix_to_the_others(
    model: str, make_tiny_engine: MakeEngine
) -> None:
    def run(engine: Engine) -> list[EngineEvent]:
        events: list[EngineEvent] = []
        engine.submit(_request("a", BASE[:20], max_new=3))
        _drain(engine, events)
        for i in range(3):
            engine.submit(_request(f"s{i}", BASE[:20] + OTHER[i:i + 2], max_new=10))
        events += engine.step()
        events += engine.step()
        engine.cancel("s0")
        engine.cancel("s2")
        _drain(engine, events)
        return events
    off, on, engine = _both(make_tiny_engine, model, run)
    assert on["s1"] == off["s1"] and on["s0"] == off["s0"] and on["s2"] == off["s2"]
    assert engine.statistics().prefix_cache_hits == 3 * 4 * 5
