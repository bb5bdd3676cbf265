"""What a constraint may cost, at the engine (issue 43, items 1, 2 and 6).

A nested-count regex of 17 characters, ``((a{60}){60}){60}``, compiled in a millisecond
under the library's default limits, then cost 50-150 ms of mask work per row per step
and tens of MB each, kept in the cache; one like ``(.{1,50}){1,50}z`` compiled, was
cached, and failed at the first token of every request. Now each is refused at
compile, and never kept; a row whose mask still goes over the step's budget ends alone.

On the tiny random GPT-2 with its byte-level BPE tokenizer (384 tokens): the lexer's
blow-up is the pattern's, not the vocabulary's (the nested counts cost 500-700 ms at
their first mask here too under the default limits).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest

from engine import (
    Constraint,
    ConstraintKind,
    EngineEvent,
    FinishEvent,
    FinishReason,
    GenerationRequest,
    InvalidConstraint,
    TokenEvent,
)
from engine.engine import Engine

MakeEngine = Callable[..., Engine]

NESTED = "((a{60}){60}){60}"


def _regex(pattern: str) -> Constraint:
    return Constraint(ConstraintKind.REGEX, pattern)


def _schema(schema: object) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


# The pattern and kin: in a regex, a schema's string ``pattern``, a tool's
# parameters (a schema too, as the routes build it), and a fourth level of nesting.
HOSTILE = [
    _regex(NESTED),
    _regex("(((a{20}){20}){20}){20}"),
    _schema({"type": "string", "pattern": f"^{NESTED}$"}),
    _schema({"type": "object", "properties": {"q": {"type": "string", "pattern": NESTED}},
             "required": ["q"]}),
]
ORDINARY = [
    Constraint(ConstraintKind.JSON_OBJECT, ""),
    _regex(r"[a-c]{3}-[0-9]{2}"),
    _regex(r"[a-zA-Z0-9._%+-]{1,64}@[a-zA-Z0-9.-]{1,255}\.[a-zA-Z]{2,24}"),
    _schema({"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[A-Z][a-z]+$", "maxLength": 12},
        "when": {"type": "string", "format": "date-time"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "n": {"type": "integer", "minimum": 0, "maximum": 999}},
        "required": ["city", "n"]}),
    Constraint(ConstraintKind.GRAMMAR, 'start: "yes" | "no" | "maybe " NUM\nNUM: /[0-9]/'),
]


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _run(engine: Engine, limit: int = 500) -> list[EngineEvent]:
    events: list[EngineEvent] = []
    for _ in range(limit):
        if not engine.has_work():
            return events
        events += engine.step()
    raise AssertionError("the engine still has work")


@pytest.mark.parametrize("constraint", HOSTILE, ids=["regex", "deeper", "pattern", "tool"])
def test_a_nested_count_constraint_is_refused_at_compile_and_never_kept(
        make_tiny_engine: MakeEngine, constraint: Constraint) -> None:
    engine = make_tiny_engine()
    with pytest.raises(InvalidConstraint, match="costs too much"):
        engine.compile_constraint(constraint)
    assert not engine.constraint_cached(constraint)
    with pytest.raises(InvalidConstraint):  # the submit compiles it again: refused again
        engine.submit(GenerationRequest("r", "A", 4, constraint=constraint))
    assert not engine.has_work()


def test_a_constraint_failing_at_its_first_mask_is_refused_at_compile(
        make_tiny_engine: MakeEngine) -> None:
    """The library's constructor accepts it; its first mask runs out of the lexer's
    fuel ("too many expressions constructed", as ``(.{1,50}){1,50}z`` does on the
    embedded tokenizer under the default limits): such a template was cached, and
    every request of it failed at its first token, a 500. Now: refused, not kept."""
    engine = make_tiny_engine()
    with pytest.raises(InvalidConstraint, match=r"mask 0 fails: .*too many expressions"):
        engine.compile_constraint(HOSTILE[0])
    assert not engine.constraint_cached(HOSTILE[0])
    assert engine._intake.constraints._cache.bytes == 0


def test_ordinary_constraints_compile_and_run_under_the_limits(
        make_tiny_engine: MakeEngine) -> None:
    engine = make_tiny_engine()
    for index, constraint in enumerate(ORDINARY):
        engine.compile_constraint(constraint)
        assert engine.constraint_cached(constraint)
        engine.submit(GenerationRequest(f"r{index}", "The answer:", 24, constraint=constraint))
    ends = [e for e in _run(engine) if isinstance(e, FinishEvent)]
    assert len(ends) == len(ORDINARY)
    assert all(e.reason is not FinishReason.ERROR for e in ends), ends


def test_distinct_nested_counts_do_not_grow_the_process(make_tiny_engine: MakeEngine) -> None:
    """Under the default limits each of these kept tens of MB in the cache (16 of them:
    1,030 MB, in the issue); refused at compile, what they built is dropped."""
    engine = make_tiny_engine()
    engine.compile_constraint(ORDINARY[0])  # the library's tokenizer, built once
    before = _resident_bytes()
    for letter in "abcdefgh":
        with pytest.raises(InvalidConstraint):
            engine.compile_constraint(_regex(f"(({letter}{{60}}){{60}}){{60}}"))
    assert _resident_bytes() - before < 100 * 2**20
    assert engine._intake.constraints._cache.bytes < 2**20


def test_the_cache_is_per_namespace(make_tiny_engine: MakeEngine) -> None:
    """A key finds only what it compiled: another key's hit would tell it, by its
    time, that the schema was used."""
    engine = make_tiny_engine()
    schema = ORDINARY[3]
    engine.compile_constraint(schema, b"key-a")
    assert engine.constraint_cached(schema, b"key-a")
    assert not engine.constraint_cached(schema, b"key-b")
    compiled = engine._intake.constraints.num_compiled
    engine.compile_constraint(schema, b"key-b")
    assert engine._intake.constraints.num_compiled == compiled + 1


def test_a_row_over_the_mask_budget_ends_alone(make_tiny_engine: MakeEngine) -> None:
    """With the library's default limits and no compile trial (as a dear constraint
    that passed both would be), the nested count reaches the step: its row ends at its
    first mask with a clear error, its blocks released; the cheap constrained row and
    the free one beside it finish as they would have."""
    from engine.constraint_costs import ConstraintCosts

    costs = ConstraintCosts(limits=None, trial_mask_ms=float("inf"), mask_ms=30.0,
                            max_template_bytes=2**40)
    engine = make_tiny_engine(constraint_costs=costs)
    engine.submit(GenerationRequest("dear", "A", 8, constraint=_regex(NESTED)))
    engine.submit(GenerationRequest("cheap", "A", 8, constraint=ORDINARY[1]))
    engine.submit(GenerationRequest("free", "A", 8))
    events = _run(engine)
    ends = {e.request_id: e for e in events if isinstance(e, FinishEvent)}
    tokens = {rid: [e for e in events if isinstance(e, TokenEvent) and e.request_id == rid]
              for rid in ends}
    assert ends["dear"].reason is FinishReason.ERROR
    assert "over the step's budget of 30 ms" in (ends["dear"].error or "")
    assert tokens["dear"] == [] or tokens["dear"][-1].index == 0
    assert ends["cheap"].reason is FinishReason.STOP
    assert ends["free"].reason is FinishReason.LENGTH and len(tokens["free"]) == 8


def test_the_cache_is_bounded_by_bytes_and_a_key_evicts_only_its_own() -> None:
    """By bytes, not count; a key over its share evicts its own least recently used;
    over the total, the owner holding the most gives way, never one within its share."""
    from engine.constraint_cache import TemplateCache

    cache = TemplateCache(total_bytes=100, share_bytes=40)
    cache.put((b"b", _regex("b1")), "B1", "victim", 30)
    for index in range(10):  # one key's flood of distinct constraints
        cache.put((b"a", _regex(f"a{index}")), f"A{index}", "hostile", 20)
        assert cache.owner_bytes("hostile") <= 40 and cache.bytes <= 100
    assert cache.get((b"b", _regex("b1"))) == "B1"
    assert cache.get((b"a", _regex("a9"))) == "A9" and cache.get((b"a", _regex("a0"))) is None
    cache.put((b"c", _regex("c1")), "C1", "third", 35)  # 30 + 40 + 35 > 100
    assert cache.bytes <= 100 and cache.owner_bytes("hostile") == 20
    assert cache.get((b"b", _regex("b1"))) == "B1" and cache.get((b"c", _regex("c1"))) == "C1"
    cache.put((b"a", _regex("big")), "X", "hostile", 41)  # over a share: not kept
    assert cache.get((b"a", _regex("big"))) is None


def test_a_template_over_the_byte_limit_is_refused_and_not_kept(
        make_tiny_engine: MakeEngine) -> None:
    """Under the library's default limits, and with no time budget, the nested count
    still grows the process by tens of MB at its first masks: refused by its size."""
    from engine.constraint_costs import ConstraintCosts

    costs = ConstraintCosts(limits=None, trial_mask_ms=float("inf"),
                            max_template_bytes=16 * 2**20)
    engine = make_tiny_engine(constraint_costs=costs)
    with pytest.raises(InvalidConstraint, match="MB compiled, over the limit of 16 MB"):
        engine.compile_constraint(HOSTILE[0])
    assert not engine.constraint_cached(HOSTILE[0])
