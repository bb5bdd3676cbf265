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

from engine import FinishEvent, FinishReason

from .tool_formats import tool_scanner
from .tool_stream import ArgumentsDelta, CallStart, TextDelta, ToolEvent

CALL_ID_PREFIX = "call_"


def call_id(request_id: str, index: int, prefix: str = CALL_ID_PREFIX) -> str:
    return f"{prefix}{request_id}_{index}"


class ToolDeltas:
    """One streamed answer's deltas (the module docstring)."""

    def __init__(self, request_id: str, tools: bool | str | None = True) -> None:
        self.request_id = request_id
        self.scanner = tool_scanner(tools)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The chat deltas the next text of the answer completes."""
        return self._deltas(self.scanner.feed(text))

    def end(self) -> list[dict[str, Any]]:
        return self._deltas(self.scanner.end())

    def finish_reason(self, finish: FinishEvent, otherwise: str) -> str:
        """``tool_calls`` if a call was made and not cut short, else ``otherwise``."""
        if self.scanner.made_calls and finish.reason is not FinishReason.LENGTH:
            return "tool_calls"
        return otherwise

    def _deltas(self, events: list[ToolEvent]) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for event in events:
            if isinstance(event, TextDelta):
                deltas.append({"content": event.text})
            elif isinstance(event, CallStart):
                deltas.append({"tool_calls": [{
                    "index": event.index, "id": call_id(self.request_id, event.index),
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
    scanner = tool_scanner(tools)
    events = scanner.feed(text) + scanner.end()
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    calls = [{"id": call_id(request_id, index), "type": "function",
              "function": {"name": call.name, "arguments": call.arguments}}
             for index, call in enumerate(scanner.calls) if call.started]
    message: dict[str, Any] = {"role": "assistant", "content": None if calls else content,
                               "refusal": None}
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)
