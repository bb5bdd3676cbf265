"""Anthropic's ``output_config``: the answer's form (structured output) and its effort.

* ``format``: ``{"type": "json_schema", "schema": {...}}``, what the official SDK's
  ``client.messages.parse(output_format=SomeModel)`` sends (no beta header): the answer
  is one JSON document of that schema, in one text block. Served through the same
  constraint as chat's ``response_format`` (``tools.json_schema_constraint``; the
  engine bounds a number's digits and free whitespace where the schema does not,
  ``engine.json_bounds``), the schema's size checked by the body (``limits.py``).
  With ``tools`` the answer is a call or a document of the schema, as with chat's
  ``tools`` and ``response_format`` together.
* ``effort``: how much a Claude model should think and write. It is the Anthropic
  route's one way to ask for it, with no chat template variable behind it to read;
  refused unless null (400 naming ``output_config.effort``) rather than silently
  dropped.

Any other member is refused as an unknown field, as Anthropic's API does; ``{}`` asks
for nothing.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError


class JsonOutputFormat(BaseModel):
    """``output_config.format``: a JSON document of ``schema``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """``output_config`` (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    format: JsonOutputFormat | None = None
    effort: Any = None

    @field_validator("effort")
    @classmethod
    def _no_effort(cls, value: object) -> object:
        if value is not None:
            raise PydanticCustomError(
                "unsupported", "this server does not support an effort level; it "
                "accepts only null (one model, answering as it does)")
        return value

    @property
    def answer_schema(self) -> dict[str, Any] | None:
        """The schema the answer must be a document of, or None for free text."""
        return None if self.format is None else self.format.schema_
