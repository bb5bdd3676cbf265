"""A chat answer in the generic tool format (or the model's own: ``tool_formats.py``),
as OpenAI sends tool calls.

A request with tools (``app.schemas.tools``) is answered with ``{"tool_calls": [...]}``
or ``{"response": ...}``; a client expects neither, but OpenAI's shapes:

* streamed (``ToolDeltas``, driven by ``OpenAIChunks``): each call's first delta is
  ``{"tool_calls": [{"index": i, "id": "call_...", "type": "function", "function":
  {"name": ..., "arguments": ""}}]}``, then ``{"tool_calls": [{"index": i, "function":
  {"arguments": <fragment>}}]}`` as its arguments are generated; a response's text is
  ``{"content": ...}`` deltas; the last chunk's ``finish_reason`` is ``tool_calls`` when a
  call was made (unless the answer was cut at ``max_tokens``: ``length``);
* whole (``tool_message``): ``message.tool_calls`` (``content`` null) or
  ``message.content``.

Each call's id is the server's: ``call_`` and the request's id and the call's index, so
ids are unique across a conversation. Log-probabilities are not reported in tool answers.
"""

from __future__ import annotations

from typing import Any

from engine import FinishEvent, FinishReason, TokenEvent

from .output_parser import OutputEvent, ToolCalls
from .tool_call_scanner import ArgumentsDelta, CallStart, TextDelta

CALL_ID_PREFIX = "call_"


class ToolDeltas:
    """One streamed answer's deltas (the module docstring), of the one output parser
    (``output_parser.ToolCalls``)."""

    def __init__(self, request_id: str, tools: bool | str | None = True) -> None:
        self.request_id = request_id
        self.parser = ToolCalls(CALL_ID_PREFIX + request_id, tools)

    def feed(self, token: TokenEvent) -> list[dict[str, Any]]:
        """The chat deltas the next token of the answer completes."""
        return self._deltas(self.parser.feed(token))

    def end(self) -> list[dict[str, Any]]:
        return self._deltas(self.parser.end())

    def finish_reason(self, finish: FinishEvent, otherwise: str) -> str:
        """``tool_calls`` if a call was made and not cut short, else ``otherwise``."""
        if self.parser.made_calls and finish.reason is not FinishReason.LENGTH:
            return "tool_calls"
        return otherwise

    def _deltas(self, events: list[OutputEvent]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, TextDelta):
                deltas.append({"content": event.text})
            elif isinstance(event, CallStart):
                deltas.append({"tool_calls": [{
                    "index": event.index, "id": self.parser.call_id(event.index),
                    "type": "function", "function": {"name": event.name, "arguments": ""},
                }]})
            elif isinstance(event, ArgumentsDelta):
                deltas.append({"tool_calls": [{"index": event.index,
                                               "function": {"arguments": event.fragment}}]})
        return deltas


def tool_message(request_id: str, text: str,
                 tools: bool | str | None = True) -> tuple[dict[str, Any], bool]:
    """A whole answer's ``message`` and whether it made calls; ``tools``: its format
    (True: the generic one; ``tool_formats.tool_scanner``)."""
    parser = ToolCalls(CALL_ID_PREFIX + request_id, tools)
    content = parser.read_whole(text)
    calls = [{"id": parser.call_id(index), "type": "function",
              "function": {"name": call.name, "arguments": call.arguments}}
             for index, call in enumerate(parser.calls) if call.started]
    message: dict[str, Any] = {"role": "assistant", "content": None if calls else content,
                               "refusal": None}
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)
