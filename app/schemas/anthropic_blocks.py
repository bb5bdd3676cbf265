"""The Anthropic Messages content blocks and tool fields this server serves.

* content blocks: ``text``; in an assistant turn ``tool_use`` (``{"id", "name",
  "input"}``: a call it made); in a user turn ``tool_result`` (``{"tool_use_id",
  "content", "is_error"}``, the content a string or text blocks). A turn is rendered as
  its text and its tool blocks in the generic tool format (``tools.py``), in order;
  other block types (images, documents, thinking) are refused naming their index;
* ``tools``: client tools ``{"name", "description", "input_schema"}`` (``type``
  ``custom`` or absent; Anthropic's server tools, such as web search, are refused);
* ``tool_choice``: ``{"type": "auto" | "any" | "tool" | "none", "name"?,
  "disable_parallel_tool_use"?}``; ``any`` requires a call, ``tool`` one of ``name``,
  ``none`` neither shows nor constrains the tools.

Pure pydantic models and their mapping to ``tools.ToolUse``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .content_text import content_text
from .tools import CallsText, ToolSpec, ToolUse, calls_text, result_text

ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
SERVED_BLOCKS = frozenset({"text", "tool_use", "tool_result"})


class TextBlock(BaseModel):
    """A text content block; ``cache_control`` is a caching hint (the answer is the same),
    ``citations`` only empty."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: Annotated[list[Any], Field(max_length=0)] | None = None


class ToolUseBlock(BaseModel):
    """A call the assistant made (its ``id`` comes back in the result)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolResultBlock(BaseModel):
    """A call's result, in the next user turn."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict[str, Any] | None = None

    @property
    def text(self) -> str:
        return content_text(self.content)


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


def turn_text(blocks: list[ContentBlock], names: dict[str, str],
              write_calls: CallsText = calls_text) -> str:
    """A turn's blocks as one text: text blocks as they are, a run of calls as one
    ``{"tool_calls": ...}`` (or as ``write_calls`` writes them: the answer's format),
    each result as its ``tool_response``; newline-joined. ``names``: each earlier
    call's name by its id (this turn's calls are added)."""
    parts: list[str] = []
    calls: list[tuple[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolUseBlock):
            calls.append((block.name, block.input))
            names[block.id] = block.name
            continue
        if calls:
            parts.append(write_calls(calls, ""))
            calls = []
        if isinstance(block, TextBlock):
            parts.append(block.text)
        else:
            parts.append(result_text(block.tool_use_id, names.get(block.tool_use_id),
                                     block.text, bool(block.is_error)))
    if calls:
        parts.append(write_calls(calls, ""))
    return "\n".join(parts)


class AnthropicTool(BaseModel):
    """A client tool: the model may call it with input matching ``input_schema``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None  # strict or not, the input is constrained

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, value: dict[str, Any]) -> dict[str, Any]:
        if value.get("type") != "object":
            raise ValueError('input_schema is the schema of an object: its "type" is "object"')
        return value


class ToolChoice(BaseModel):
    """``tool_choice``: ``auto``, ``any``, ``tool`` (with ``name``) or ``none``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


def check_tools(tools: list[AnthropicTool] | None, choice: ToolChoice | None) -> None:
    """Refuse tools named twice, a ``tool`` choice without its ``name`` or naming no
    tool, and a choice that asks for a call without tools (raises ValueError)."""
    names = [t.name for t in tools or ()]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"tools name {twice[0]!r} more than once")
    if choice is None:
        return
    if (choice.type == "tool") != (choice.name is not None):
        raise ValueError('tool_choice has a name with type "tool", and only then')
    if choice.type in ("any", "tool") and not names:
        raise ValueError("tool_choice asks for a tool call, but the request has no tools")
    if choice.name is not None and choice.name not in names:
        raise ValueError(f"tool_choice names the tool {choice.name[:64]!r}, which is not "
                         f"among the tools ({', '.join(names)[:200]})")


def anthropic_tool_use(tools: list[AnthropicTool] | None, choice: ToolChoice | None,
                       answer_schema: dict[str, Any] | None = None) -> ToolUse | None:
    """What the request asks of its tools, or None: no tools, or ``none``;
    ``answer_schema`` (``output_config.format``) is what an answer that calls none
    must be a document of."""
    kind = "auto" if choice is None else choice.type
    if not tools or kind == "none":
        return None
    return ToolUse(
        tools=tuple(ToolSpec(t.name, t.description, t.input_schema) for t in tools),
        required=kind in ("any", "tool"),
        named=choice.name if choice is not None else None,
        parallel=not (choice is not None and choice.disable_parallel_tool_use),
        response_schema=answer_schema,
    )
