"""The validators of a body's ``tools`` and ``tool_choice`` fields, written once.

The chat and Messages bodies check their tools the same way and word the refusals in
their own API's terms: the tools within the server's limits (``limits.
check_tools_within_limit``: how many, and their schemas' bytes), no name given twice
(400 ``invalid_tools``), and a ``tool_choice`` that names one of them or asks for a
call only with tools (400 ``invalid_tool_choice``). What differs is each API's: where a
tool keeps its schema, what the refusal calls those schemas, and the checker of names
and choice (``openai_tools.check_tools``, ``anthropic_blocks.check_tools``), whose
``ValueError`` messages are the refusals' words. The Responses body checks its tools in
its model validator, with its own words (``responses.py``), and shares the limits only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from .limits import check_tools_within_limit, limits_of

# Refuse tools named twice (choice None) and a choice the tools cannot answer.
ToolsCheck = Callable[[Any, Any], None]


def tool_field_validators(how: str, schema_of: Callable[[Any], Any], schemas_are: str,
                          check: ToolsCheck) -> tuple[Any, Any]:
    """The two field validators of a body with ``tools`` and ``tool_choice``: assign
    them in the class body (``_tools_checked, _choice_checked = ...``).

    Args:
        how: what ``limits_of`` says when the body is validated without its limits.
        schema_of: a tool's schema of its arguments, as the limit counts its bytes.
        schemas_are: the refusal's name for the tools' schemas together.
        check: ``check(tools, choice)`` raising ValueError with the refusal's words.
    """

    def tools_within_limit(cls: Any, value: list[Any] | None, info: ValidationInfo
                           ) -> list[Any] | None:
        if value:
            check_tools_within_limit([schema_of(t) for t in value], limits_of(info, how),
                                     schemas_are)
        try:
            check(value, None)  # names given twice
        except ValueError as exc:
            raise PydanticCustomError("invalid_tools", str(exc)) from None
        return value

    def choice_among_tools(cls: Any, value: object, info: ValidationInfo) -> object:
        if "tools" in info.data:  # else the tools were refused already
            try:
                check(info.data["tools"], value)
            except ValueError as exc:
                raise PydanticCustomError("invalid_tool_choice", str(exc)) from None
        return value

    return (field_validator("tools")(classmethod(tools_within_limit)),  # type: ignore[arg-type]
            field_validator("tool_choice")(classmethod(choice_among_tools)))  # type: ignore[arg-type]
