"""The items of a Responses API conversation and how they become chat-template turns.

An input item (``POST /v1/responses``' ``input``, a stored response's output sent back
through ``previous_response_id``) is a message whose content is text parts
(``input_text``, ``output_text``; a string is one part), a function call the model made,
or a call's output. Any other kind (``reasoning``, ``item_reference``, an image or a
file part) is refused by the body's validation. ``template_messages`` renders them for
the model's chat template, past calls in the format the answer is in (the generic one,
``tools.py``, or the model's own, ``tool_formats.py``): the model reads its past calls
as it writes them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
)

from .content_text import content_text
from .tools import CallsText, arguments_value, calls_text, result_text

_FROZEN = ConfigDict(extra="ignore", strict=True, frozen=True)


class TextPart(BaseModel):
    """A text part of a message: ``input_text`` (the user's) or ``output_text`` (an
    assistant's, as a previous response returned it; its annotations are ignored)."""

    model_config = _FROZEN

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    """A message item (``type`` may be left out, as in OpenAI's easy input form)."""

    model_config = _FROZEN

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[TextPart]
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _string_is_one_part(cls, value: object, info: ValidationInfo) -> object:
        """A string is one text part (OpenAI's easy form; the stored items are parts)."""
        if isinstance(value, str):
            kind = "output_text" if info.data.get("role") == "assistant" else "input_text"
            return [{"type": kind, "text": value}]
        return value


class FunctionCallItem(BaseModel):
    """A call the model made (a previous response's output item, sent back)."""

    model_config = _FROZEN

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    """The result of a call, for the model to read."""

    model_config = _FROZEN

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[TextPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return content_text(self.output)


def _item_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_kind, custom_error_type="unsupported_item",
                  custom_error_message="this server takes message, function_call and "
                                       "function_call_output items only"),
]


def content_parts(items: list[dict[str, Any]]) -> int:
    """How many text parts ``items`` (``template_messages``' form) carry, as the chat
    routes count them for ``max_content_parts``: a message's parts, a call output's parts
    (a string is one), a call is one."""
    count = 0
    for item in items:
        kind = item.get("type", "message")
        content = item.get("output") if kind == "function_call_output" else item.get("content")
        count += 1 if kind == "function_call" or isinstance(content, str) else len(content or ())
    return count


def template_messages(items: list[dict[str, Any]],
                      write_calls: CallsText = calls_text) -> list[dict[str, str]]:
    """Input items (``ResponsesBody.input_items``' form, or a stored response's output
    items) as chat-template turns: messages as they are (``developer`` as ``system``),
    consecutive function calls as one assistant turn, as ``write_calls`` writes them
    (the answer's format; by default the generic one, ``tools.calls_text``), and a
    call's output as a user turn (``tools.result_text``)."""
    turns: list[dict[str, str]] = []
    names: dict[str, str] = {}  # call_id -> name, for the outputs
    calls: list[tuple[str, Any]] = []

    def flush() -> None:
        if calls:
            turns.append({"role": "assistant", "content": write_calls(list(calls), "")})
            calls.clear()

    for item in items:
        kind = item.get("type", "message")
        if kind == "function_call":
            names[item["call_id"]] = item["name"]
            calls.append((item["name"], arguments_value(item["arguments"])))
            continue
        flush()
        if kind == "function_call_output":
            output = item["output"]
            text = output if isinstance(output, str) else "\n".join(
                p.get("text", "") for p in output)
            turns.append({"role": "user", "content": result_text(
                item["call_id"], names.get(item["call_id"]), text)})
        else:
            content = item["content"]
            text = content if isinstance(content, str) else "\n".join(
                p.get("text", "") for p in content)
            role = item["role"]
            turns.append({"role": "system" if role == "developer" else role, "content": text})
    flush()
    return turns
