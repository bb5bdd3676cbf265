"""The native ``constraint`` object: the form a stream's output must take.

``{"type": "json_schema", "schema": {...}}``, ``{"type": "json_object"}``,
``{"type": "regex", "pattern": "..."}`` or ``{"type": "grammar", "grammar": "..."}``
(a Lark grammar in llguidance's dialect, ``start`` its rule). Validated here: its shape
(strict, unknown fields refused) and its size (``RequestLimits.max_constraint_chars``
characters of its source, so a client cannot make the server compile something huge).
Whether it compiles is the engine's to say (``Engine.compile_constraint``, run by the
runtime before the stream opens: a 422 ``invalid_request`` with the library's message).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError

from engine import Constraint, ConstraintKind

_STRICT = ConfigDict(extra="forbid", strict=True, frozen=True)


class JsonSchemaConstraint(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True,
                              populate_by_name=False)
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")

    def to_constraint(self) -> Constraint:
        return Constraint(ConstraintKind.JSON_SCHEMA,
                          json.dumps(self.json_schema, separators=(",", ":")))


class JsonObjectConstraint(BaseModel):
    model_config = _STRICT
    type: Literal["json_object"]

    def to_constraint(self) -> Constraint:
        return Constraint(ConstraintKind.JSON_OBJECT)


class RegexConstraint(BaseModel):
    model_config = _STRICT
    type: Literal["regex"]
    pattern: str = Field(min_length=1)

    def to_constraint(self) -> Constraint:
        return Constraint(ConstraintKind.REGEX, self.pattern)


class GrammarConstraint(BaseModel):
    model_config = _STRICT
    type: Literal["grammar"]
    grammar: str = Field(min_length=1)

    def to_constraint(self) -> Constraint:
        return Constraint(ConstraintKind.GRAMMAR, self.grammar)


ConstraintBody = Annotated[
    JsonSchemaConstraint | JsonObjectConstraint | RegexConstraint | GrammarConstraint,
    Field(discriminator="type"),
]


def check_constraint_size(constraint: Constraint, limit: int) -> None:
    """Refuse a constraint whose source is longer than the server allows."""
    if len(constraint.source) > limit:
        raise PydanticCustomError(
            "constraint_too_long",
            "the constraint is {length} characters, over the limit of {limit}",
            {"length": len(constraint.source), "limit": limit},
        )

