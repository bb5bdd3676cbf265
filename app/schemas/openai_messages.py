"""The messages of ``/v1/chat/completions``, and how a chat template gets them.

A message is ``system`` (or ``developer``, OpenAI's newer name), ``user``,
``assistant`` or ``tool``; its content a string or text parts (joined by newlines, as
vLLM does). An assistant message may carry the ``tool_calls`` it made, a ``tool``
message the result of one; both are rendered as text in the generic tool format
(``tools.py``), so a model whose template knows no tools reads a round trip as it wrote
it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from .content_text import content_text
from .tools import CallsText, arguments_value, calls_text, result_text


class TextPart(BaseModel):
    """One part of a message's content in the list form; only text parts are served."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    name: str
    arguments: str  # JSON text, as the SDK sends it back


class PastToolCall(BaseModel):
    """A call an assistant message made, as the answer gave it."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    """One message. ``developer`` is OpenAI's newer name for ``system``. An assistant
    message may carry the ``tool_calls`` it made (its content then may be null), a
    ``tool`` message the result of one (``tool_call_id``); both are rendered as text in
    the generic tool format (``tools.py``). The other fields an assistant message gets
    back from the SDK (``refusal``, ...) are accepted when empty; ``name`` is ignored
    (chat templates do not show it)."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[PastToolCall] | None = None
    tool_call_id: str | None = None
    function_call: None = None
    audio: None = None
    refusal: None = None

    @model_validator(mode="after")
    def _content_as_the_role_needs(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise PydanticCustomError("missing", "content is required (null only in an "
                                      "assistant message with tool_calls)")
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("unexpected", "only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise PydanticCustomError("missing", "a tool message, and only a tool message, "
                                      "has a tool_call_id")
        return self

    @property
    def parts(self) -> int:
        """How many text parts the content has (a string is one, none is none)."""
        if self.content is None:
            return 0
        return 1 if isinstance(self.content, str) else len(self.content)

    @property
    def text(self) -> str:
        """The content's text: parts joined by newlines (as vLLM does)."""
        return content_text(self.content)

    def as_template_input(self, names: dict[str, str] | None = None,
                          write_calls: CallsText = calls_text) -> dict[str, str]:
        """``{"role", "content"}`` as a chat template expects it: ``developer`` as
        ``system``; past tool calls (as ``write_calls`` writes them) and results as text
        (``names``: each earlier call's function by its id, for a result's turn)."""
        if self.role == "tool":
            name = (names or {}).get(self.tool_call_id or "")
            return {"role": "user", "content": result_text(self.tool_call_id, name, self.text)}
        if self.tool_calls:
            calls = [(c.function.name, arguments_value(c.function.arguments))
                     for c in self.tool_calls]
            return {"role": "assistant", "content": write_calls(calls, self.text)}
        return {"role": "system" if self.role == "developer" else self.role,
                "content": self.text}


def template_input(messages: list[ChatMessage],
                   write_calls: CallsText = calls_text) -> list[dict[str, str]]:
    """The messages as a chat template takes them, tool turns as text (past calls as
    ``write_calls`` writes them: the answer's format)."""
    names: dict[str, str] = {}
    turns = []
    for message in messages:
        turns.append(message.as_template_input(names, write_calls))
        for call in message.tool_calls or ():
            names[call.id] = call.function.name
    return turns
