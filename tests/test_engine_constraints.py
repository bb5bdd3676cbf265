"""Constrained decoding in the engine: output conforms, every rebuild path replays the
matcher, and concurrent equals solo with constraints.

On the tiny random models (byte-level BPE tokenizer trained in-process): the model's
choice is random, so every check is that the output conforms and that the tokens do
not depend on batch mates, preemption, chunking, the prefix cache or a rebuild.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest

from engine import (
    Constraint,
    ConstraintKind,
    EngineEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    InvalidConstraint,
    SamplingParams,
    TokenEvent,
)
from engine.engine import Engine

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["n", "ok", "unit"],
    "additionalProperties": False,
}
JSON_SCHEMA = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
REGEX = Constraint(ConstraintKind.REGEX, r"[a-c]{3}-[0-9]{2}")
GRAMMAR = Constraint(ConstraintKind.GRAMMAR, 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/')
FINITE = [JSON_SCHEMA, REGEX, GRAMMAR]
GREEDY = SamplingParams()
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
OPTIONS = {"max_batch": 16, "num_blocks": 256, "block_size": 4}
PROMPTS = ["The answer, as JSON:", "A", "Every stream has an owner, and", "日本語 🙂"]

MakeEngine = Callable[..., Engine]


def _run(engine: Engine, limit: int = 1_000) -> list[EngineEvent]:
    events: list[EngineEvent] = []
    for _ in range(limit):
        if not engine.has_work():
            return events
        events += engine.step()
    raise AssertionError("the engine still has work")


def _request(rid: str, prompt: str, constraint: Constraint | None,
             sampling: SamplingParams = GREEDY, max_new: int = 48) -> GenerationRequest:
    return GenerationRequest(rid, prompt, max_new, sampling=sampling, constraint=constraint)


def _outputs(events: list[EngineEvent]) -> dict[str, tuple[list[int], str, FinishReason]]:
    ids: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    ends: dict[str, FinishReason] = {}
    for event in events:
        if isinstance(event, TokenEvent):
            assert event.index == len(ids.setdefault(event.request_id, []))
            ids[event.request_id].append(event.token_id)
            texts[event.request_id] = texts.get(event.request_id, "") + event.text
        elif isinstance(event, FinishEvent):
            ends[event.request_id] = event.reason
    return {rid: (ids.get(rid, []), texts.get(rid, ""), reason) for rid, reason in ends.items()}


def _conforms(constraint: Constraint, text: str) -> bool:
    if constraint is REGEX:
        return re.fullmatch(REGEX.source, text) is not None
    if constraint is GRAMMAR:
        return re.fullmatch(r"yes|no|maybe [0-9]", text) is not None
    doc: Any = json.loads(text)
    if constraint.kind is ConstraintKind.JSON_OBJECT:
        return isinstance(doc, dict)
    return (set(doc) == {"n", "ok", "unit"} and isinstance(doc["n"], int)
            and 0 <= doc["n"] <= 999 and isinstance(doc["ok"], bool)
            and doc["unit"] in ("celsius", "fahrenheit"))


def _solo(make: MakeEngine, request: GenerationRequest, model: str = "tiny-gpt2",
          **options: Any) -> tuple[list[int], str, FinishReason]:
    engine = make(model, **{**OPTIONS, **options})
    engine.submit(request)
    return _outputs(_run(engine))[request.request_id]


MODELS = pytest.mark.parametrize("model", ["tiny-gpt2", "tiny-llama"])


@MODELS
@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_each_constraint_gives_conforming_output_that_ends_with_its_grammar(
        make_tiny_engine: MakeEngine, model: str, sampling: SamplingParams) -> None:
    for constraint in FINITE:
        for i, prompt in enumerate(PROMPTS):
            _, text, reason = _solo(make_tiny_engine, _request(f"r{i}", prompt, constraint,
                                                                  sampling), model)
            assert reason in (FinishReason.STOP, FinishReason.EOS), (constraint, text)
            assert _conforms(constraint, text), (constraint.kind, text)


def test_any_json_object_is_an_object(make_tiny_engine: MakeEngine) -> None:
    constraint = Constraint(ConstraintKind.JSON_OBJECT)
    engine = make_tiny_engine(**OPTIONS)
    for i, prompt in enumerate(PROMPTS):
        engine.submit(_request(f"r{i}", prompt, constraint, max_new=200))
    for _, text, reason in _outputs(_run(engine)).values():
        assert text.startswith("{")
        if reason is not FinishReason.LENGTH:  # a random model may write a long object
            assert reason is FinishReason.STOP and isinstance(json.loads(text), dict), text


@MODELS
def test_concurrent_equals_solo_with_constraints(make_tiny_engine: MakeEngine, model: str) -> None:
    """Constrained and free rows, greedy and seeded, in one batch: each row's tokens are
    its solo run's."""
    requests = []
    for i, prompt in enumerate(PROMPTS):
        for j, constraint in enumerate([*FINITE, None]):
            for k, sampling in enumerate([SamplingParams(), SEEDED]):
                requests.append(_request(f"r{i}-{j}-{k}", prompt, constraint, sampling, 24))
    solo = {r.request_id: _solo(make_tiny_engine, r, model) for r in requests}
    engine = make_tiny_engine(model, **{**OPTIONS, "max_batch": len(requests)})
    for request in requests:
        engine.submit(request)
    assert _outputs(_run(engine)) == solo


def test_a_repeated_schema_compiles_once_and_a_bad_one_is_refused_before_queueing(
        make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine(**OPTIONS)
    constraints = engine._intake.constraints
    engine.compile_constraint(JSON_SCHEMA)
    same = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))  # equal, not identical
    for i in range(3):
        engine.submit(_request(f"r{i}", "A", same))
    assert constraints.num_compiled == 1
    bad = [Constraint(ConstraintKind.JSON_SCHEMA, "{not json"),
           Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "frob"}'),
           Constraint(ConstraintKind.REGEX, "(("),
           Constraint(ConstraintKind.GRAMMAR, "start: (((")]
    for constraint in bad:
        with pytest.raises(InvalidConstraint, match="does not compile"):
            engine.submit(_request("bad", "A", constraint))
    events = _run(engine)
    assert {e.request_id for e in events if isinstance(e, FinishEvent)} == {"r0", "r1", "r2"}


def test_preemption_by_recompute_keeps_the_matcher(make_tiny_engine: MakeEngine) -> None:
    """Few blocks: sequences are preempted and recomputed; the output is the solo run's."""
    requests = [_request(f"r{i}", prompt * 3, c, s, 40) for i, (prompt, c, s) in enumerate(
        [(p, c, s) for p in PROMPTS[:3] for c in FINITE for s in (SamplingParams(), SEEDED)])]
    solo = {r.request_id: _solo(make_tiny_engine, r) for r in requests}
    engine = make_tiny_engine(max_batch=16, num_blocks=40, block_size=4)
    for request in requests:
        engine.submit(request)
    assert _outputs(_run(engine)) == solo
    assert engine.statistics().preemptions > 0


def test_chunked_prefill_samples_the_first_token_under_the_mask(
        make_tiny_engine: MakeEngine) -> None:
    prompt = "A long prompt that is prefilled in many small chunks, " * 3
    for constraint in FINITE:
        request = _request("r", prompt, constraint, SEEDED)
        assert _solo(make_tiny_engine, request, max_prefill_tokens=5) == _solo(
            make_tiny_engine, request)


def test_a_prefix_cache_hit_starts_its_matcher_fresh(make_tiny_engine: MakeEngine) -> None:
    prompt = "A shared system prompt that fills several blocks of the cache. " * 2
    engine = make_tiny_engine(**OPTIONS, prefix_cache=True)
    engine.submit(_request("first", prompt, JSON_SCHEMA))
    first = _outputs(_run(engine))["first"]
    engine.submit(_request("second", prompt, JSON_SCHEMA))
    second = _outputs(_run(engine))["second"]
    assert engine.statistics().prefix_cache_hits > 0
    assert first == second == _solo(make_tiny_engine, _request("solo", prompt, JSON_SCHEMA))
    assert _conforms(JSON_SCHEMA, second[1])


@pytest.mark.parametrize("constraint", FINITE, ids=["json", "regex", "grammar"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SEEDED], ids=["greedy", "seeded"])
def test_a_rebuilt_stream_replays_its_tokens_through_a_new_matcher(
        make_tiny_engine: MakeEngine, constraint: Constraint, sampling: SamplingParams) -> None:
    """Failover: the tokens made elsewhere are replayed; the rest is the solo run's."""
    request = _request("r", "The answer:", constraint, sampling)
    ids, _, reason = _solo(make_tiny_engine, request)
    assert len(ids) >= 2
    for cut in sorted({1, len(ids) // 2, len(ids) - 1}):
        engine = make_tiny_engine(**OPTIONS)
        engine.submit(request, resume_from=ids[:cut])
        events = _run(engine)
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert [e.index for e in tokens] == list(range(cut, len(ids)))
        assert [e.token_id for e in tokens] == ids[cut:]
        assert [e.reason for e in events if isinstance(e, FinishEvent)] == [reason]
    engine = make_tiny_engine(**OPTIONS)  # every token made already: only its finish
    engine.submit(request, resume_from=ids)
    assert [(type(e), e.reason) for e in _run(engine)] == [(FinishEvent, reason)]  # type: ignore[union-attr]


def test_replayed_tokens_the_grammar_refuses_end_the_stream_with_an_error(
        make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine(**OPTIONS)
    refused = engine.tokenize("zzz")  # REGEX starts with [a-c]
    engine.submit(_request("r", "A", REGEX), resume_from=refused)
    (finish,) = _run(engine)
    assert isinstance(finish, FinishEvent) and finish.reason is FinishReason.ERROR
    assert "not allowed by the constraint" in (finish.error or "")


def test_a_dead_end_finishes_the_row_with_an_error_and_its_batch_mates_go_on(
        make_tiny_engine: MakeEngine) -> None:
    """A matcher that allows no token (here: driven into the library's error state) ends
    its row with ERROR at the next step; the cache is whole afterwards (the fixture)."""
    engine = make_tiny_engine(**OPTIONS)
    engine.submit(_request("dead", "A", REGEX))
    engine.submit(_request("free", "A", None, max_new=8))
    engine.submit(_request("json", "A", JSON_SCHEMA))
    events = engine.step()  # prefill: each gets its first token
    dead = engine.scheduler.find("dead")
    assert dead is not None and dead.matcher is not None
    assert not dead.matcher.consume_token(engine.tokenize("9")[0])  # type: ignore[attr-defined]
    events += _run(engine)
    out = {e.request_id: e for e in events if isinstance(e, FinishEvent)}
    assert out["dead"].reason is FinishReason.ERROR
    assert "allows no further token" in (out["dead"].error or "")
    assert out["free"].reason in (FinishReason.LENGTH, FinishReason.EOS)
    assert out["json"].reason is FinishReason.STOP


def test_unconstrained_rows_do_no_mask_work(make_tiny_engine: MakeEngine,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    import llguidance.torch

    calls: list[int] = []
    fill = llguidance.torch.fill_next_token_bitmask

    def counted(matcher: Any, mask: Any, index: int = 0) -> None:
        calls.append(index)
        fill(matcher, mask, index)

    monkeypatch.setattr(llguidance.torch, "fill_next_token_bitmask", counted)
    engine = make_tiny_engine(**OPTIONS)
    for i in range(4):
        engine.submit(_request(f"free{i}", PROMPTS[i], None, max_new=6))
    _run(engine)
    assert calls == []
    engine.submit(_request("free", "A", None, max_new=30))
    engine.submit(_request("regex", "A", REGEX))
    outputs = _outputs(_run(engine))
    assert len(calls) == len(outputs["regex"][0])  # one mask per token of the constrained row
