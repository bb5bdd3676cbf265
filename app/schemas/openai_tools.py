"""The OpenAI fields that constrain an answer: ``response_format``, ``tools``, ``tool_choice``.

* ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}`` (any
  JSON object) or ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
  "description"}}`` (a document of that schema; ``strict`` or not, the answer is
  constrained to it);
* ``tools``: function tools ``{"type": "function", "function": {"name", "description",
  "parameters", "strict"}}``, names unique; ``tool_choice``: ``"none"`` (the tools are
  neither shown nor constrained), ``"auto"`` (the default with tools), ``"required"``,
  or ``{"type": "function", "function": {"name"}}`` naming one of them;
  ``parallel_tool_calls: false``: at most one call.

How they become the engine's constraint and the prompt's tool text is in ``tools.py``
(the generic format). Pure pydantic models and their mapping; the size limits are
checked by the bodies (``openai.py``) with ``limits.py``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine import Constraint, ConstraintKind

from .tools import ToolSpec, ToolUse, function_spec, json_schema_constraint

# OpenAI's rule for function and schema names.
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
ToolChoiceMode = Literal["none", "auto", "required"]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # strict or not, the arguments are constrained

    def spec(self) -> ToolSpec:
        return function_spec(self.name, self.description, self.parameters)


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True,
                              populate_by_name=True)

    name: FunctionName
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given with type "json_schema", and only then')
        return self

    def response_schema(self) -> dict[str, Any] | None:
        """The answer's schema: None for text, ``{"type": "object"}`` for any object."""
        if self.type == "text":
            return None
        if self.json_schema is not None and self.json_schema.schema_ is not None:
            return self.json_schema.schema_
        return {"type": "object"}

    def constraint(self) -> Constraint | None:
        """The engine's constraint for an answer without tools."""
        if self.type == "text":
            return None
        if self.type == "json_object" or self.json_schema is None or \
                self.json_schema.schema_ is None:
            return Constraint(ConstraintKind.JSON_OBJECT)
        return json_schema_constraint(self.json_schema.schema_)


ToolChoice = ToolChoiceMode | NamedToolChoice


def check_tools(tools: list[FunctionTool] | None, choice: ToolChoice | None) -> None:
    """Refuse a ``tool_choice`` that asks for a call without tools, or names a function
    that is not among them; and tools named twice (raises ValueError)."""
    names = [t.function.name for t in tools or ()]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tools name the function {twice[0]!r} more than once")
    if choice is None or choice in ("none", "auto"):
        return
    if not names:
        raise ValueError("tool_choice asks for a call, but the request has no tools")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ValueError(f"tool_choice names the function {choice.function.name[:64]!r}, "
                         f"which is not among the tools ({', '.join(names)[:200]})")


def openai_tool_use(
    tools: list[FunctionTool] | None, choice: ToolChoice | None, parallel: bool | None,
    response_format: ResponseFormat | None,
) -> ToolUse | None:
    """What the request asks of its tools, or None: no tools, or ``tool_choice: none``."""
    if not tools or choice == "none":
        return None
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    return ToolUse(
        tools=tuple(t.function.spec() for t in tools),
        required=choice == "required" or named is not None,
        named=named,
        parallel=parallel is not False,
        response_schema=None if response_format is None else response_format.response_schema(),
    )
