"""Default bounds on a JSON schema's numbers (``engine/json_bounds.py``, issue 45).

The pre-pass's output as data, then what the compiled constraint allows, one character
at a time through the library's matcher over a real (tiny, byte-level BPE) tokenizer:
a digit the bound rules out is masked, an explicit bound still wins; then the tiny
random model, generating under ``{"type": "integer"}``, ends within the bound.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from engine import Constraint, ConstraintKind, FinishEvent, GenerationRequest, TokenEvent
from engine.constraints import Constraints
from engine.engine import Engine
from engine.json_bounds import LARGEST, STEP, bounded
from engine.model import LoadedModel, tiny_tokenizer


@pytest.fixture(scope="module")
def constraints() -> Constraints:
    tokenizer = tiny_tokenizer()
    return Constraints(tokenizer, len(tokenizer), eos_token_ids=())


def accepts(constraints: Constraints, schema: Any, text: str) -> tuple[bool, bool]:
    """(whether every character of ``text`` is allowed in turn, whether the matcher
    may end there), feeding one token per character as a model could write it."""
    tokenizer = constraints._hf_tokenizer  # the tokenizer the constraint is compiled for
    matcher = constraints.matcher(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)))
    for char in text:
        [token] = tokenizer.encode(char, add_special_tokens=False)
        if not matcher.consume_token(token):
            return False, False
    return True, bool(matcher.is_accepting())


# -- the pre-pass -----------------------------------------------------------------------

def test_integers_and_numbers_get_bounds_wherever_they_are() -> None:
    schema = {"type": "object", "properties": {
        "population": {"type": "integer"},
        "share": {"type": ["number", "null"]},
        "rows": {"type": "array", "items": {"$ref": "#/$defs/n"}},
        "any": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "$defs": {"n": {"type": "number", "multipleOf": 0.5}}}

    out = bounded(schema)

    props = out["properties"]
    assert props["population"] == {"type": "integer", "minimum": -LARGEST, "maximum": LARGEST}
    assert props["share"] == {"type": ["number", "null"], "minimum": -LARGEST,
                              "maximum": LARGEST, "multipleOf": STEP}
    assert props["rows"] == schema["properties"]["rows"]  # a $ref: bounded where defined
    assert out["$defs"]["n"] == {"type": "number", "multipleOf": 0.5,
                                 "minimum": -LARGEST, "maximum": LARGEST}
    assert props["any"]["anyOf"][0]["maximum"] == LARGEST
    assert schema["properties"]["population"] == {"type": "integer"}  # not changed in place


def test_the_schemas_own_bounds_win_and_data_is_not_walked() -> None:
    own = {"type": "integer", "minimum": 0, "maximum": 10**20}
    above = {"type": "integer", "exclusiveMinimum": 10**18}
    data = {"enum": [{"type": "integer"}], "const": {"type": "number"},
            "properties": {"enum": {"type": "integer"}}}

    assert bounded(own) == own
    assert bounded(above) == above  # a default maximum would contradict it
    assert bounded(big := {"type": "integer", "enum": [10**18]}) == big
    assert bounded({"type": "integer", "maximum": 5})["minimum"] == -LARGEST
    out = bounded(data)
    assert (out["enum"], out["const"]) == (data["enum"], data["const"])
    assert out["properties"]["enum"]["maximum"] == LARGEST  # a property named enum is one
    assert bounded(True) is True


# -- what the compiled constraint allows ---------------------------------------------------

def test_an_integer_has_at_most_16_digits(constraints: Constraints) -> None:
    schema = {"type": "integer"}

    assert accepts(constraints, schema, "9" * 16) == (True, True)
    assert accepts(constraints, schema, "-" + "9" * 16) == (True, True)
    assert accepts(constraints, schema, "1" * 17)[0] is False


def test_an_explicit_maximum_still_wins(constraints: Constraints) -> None:
    wide = {"type": "integer", "minimum": 0, "maximum": 10**18}
    narrow = {"type": "integer", "minimum": 0, "maximum": 999}

    assert accepts(constraints, wide, "1" * 18) == (True, True)
    assert accepts(constraints, narrow, "999") == (True, True)
    assert accepts(constraints, narrow, "1000")[0] is False


def test_a_number_has_bounded_integer_and_fraction_digits(constraints: Constraints) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}

    assert accepts(constraints, schema, '{"x": -12.5}') == (True, True)
    assert accepts(constraints, schema, '{"x": 0.' + "3" * 10 + "}") == (True, True)
    assert accepts(constraints, schema, '{"x": 0.' + "3" * 11)[0] is False
    assert accepts(constraints, schema, '{"x": ' + "1" * 17)[0] is False
    assert accepts(constraints, schema, '{"x": 1e')[0] is False


def test_a_generated_integer_ends_within_the_bound(
    tiny_model: Callable[[str], LoadedModel],
) -> None:
    """The tiny random model, free to write digits (``ignore_eos``-free, budget 40):
    every answer is an integer of at most 16 digits, ended by the grammar."""
    engine = Engine(tiny_model("tiny-gpt2"), max_batch=8, num_blocks=64, block_size=16)
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"type": "integer"}))
    for n, prompt in enumerate(["Population:", "1", "Digits 9999", "A number:"]):
        engine.submit(GenerationRequest(f"r{n}", prompt, 40, constraint=constraint))
    texts: dict[str, str] = {}
    finishes: dict[str, str] = {}
    while engine.has_work():
        for event in engine.step():
            if isinstance(event, TokenEvent):
                texts[event.request_id] = texts.get(event.request_id, "") + event.text
            elif isinstance(event, FinishEvent):
                finishes[event.request_id] = event.reason.value

    assert set(finishes.values()) <= {"stop", "eos"}, (finishes, texts)  # never length
    for text in texts.values():
        assert len(text.lstrip("-")) <= 16 and int(text) == json.loads(text)
