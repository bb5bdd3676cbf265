"""What the model's text becomes, as it streams: the one output parser every encoder takes.

An encoder that must tell text from tool calls (OpenAI's chunks with tools, Anthropic's
events with tools, the Responses API's events always) reads each token through an
``OutputParser`` and writes the events it returns in its own API's shape; at the stream's
end it calls ``end`` for the events the end completes. The events are the tool-call
scanner's (``tool_call_scanner``: ``TextDelta``, ``CallStart``, ``ArgumentsDelta``,
``CallEnd``), one definition for every encoder. Two parsers:

* ``PlainText``: every token's text is the answer's text (with its log-probabilities
  when asked), a request without tools;
* ``ToolCalls``: the generic tool format's answer (``app.schemas.tools``), or the
  model's own format's (``tool_formats``), read by a ``ToolCallScanner``: each call's
  name, then its arguments' fragments, or the response's text. A call's id is
  ``<call_prefix>_<index>``, the same each time the answer is encoded (OpenAI's
  ``call_<request id>``, Anthropic's ``toolu_<request id>``). No log-probabilities (as
  on the chat route).

Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Protocol

from engine import TokenEvent

from .tool_call_scanner import ScannedCall, TextDelta, ToolEvent
from .tool_formats import tool_scanner

OutputEvent = ToolEvent


class OutputParser(Protocol):
    """Turns the model's text, as it streams, into the answer's output events."""

    @property
    def made_calls(self) -> bool:
        """Whether any call was started: the answer is a tool call, not text."""
        ...

    def feed(self, token: TokenEvent) -> list[OutputEvent]:
        """The events ``token``'s text completes."""
        ...

    def end(self) -> list[OutputEvent]:
        """The output ended (maybe cut short): the events that completes."""
        ...

    def call_id(self, index: int) -> str:
        """The id of call ``index``."""
        ...


class PlainText:
    """Every token's text is the message's text (a request without tools)."""

    def __init__(self, with_logprobs: bool = False) -> None:
        self.with_logprobs = with_logprobs

    @property
    def made_calls(self) -> bool:
        return False

    def feed(self, token: TokenEvent) -> list[OutputEvent]:
        logprobs = (output_logprobs(token),) if self.with_logprobs and token.logprobs else ()
        return [TextDelta(token.text, logprobs)] if token.text or logprobs else []

    def end(self) -> list[OutputEvent]:
        return []

    def call_id(self, index: int) -> str:
        raise ValueError("plain text makes no calls")


class ToolCalls:
    """The answer of a request with tools, in the generic tool format or in the
    model's own (``tools``: a format's name, ``tool_formats.tool_scanner``; the module
    docstring)."""

    def __init__(self, call_prefix: str, tools: bool | str | None = True) -> None:
        self.call_prefix = call_prefix
        self.scanner = tool_scanner(tools)

    @property
    def made_calls(self) -> bool:
        return self.scanner.made_calls

    @property
    def calls(self) -> list[ScannedCall]:
        """Each call as far as it was generated (its name, its arguments' JSON text)."""
        return self.scanner.calls

    def feed(self, token: TokenEvent) -> list[OutputEvent]:
        return self.feed_text(token.text)

    def feed_text(self, text: str) -> list[OutputEvent]:
        """The events ``text`` (the next characters of the answer) completes."""
        return self.scanner.feed(text)

    def end(self) -> list[OutputEvent]:
        return self.scanner.end()

    def call_id(self, index: int) -> str:
        return f"{self.call_prefix}_{index}"

    def read_whole(self, text: str) -> str:
        """A whole answer's text read at once: the text it says besides its calls
        (``calls`` then holds them)."""
        events = self.feed_text(text) + self.end()
        return "".join(e.text for e in events if isinstance(e, TextDelta))


def output_logprobs(token: TokenEvent) -> dict[str, Any]:
    """One token's entry in ``output_text``'s ``logprobs``, as OpenAI writes it."""
    lp = token.logprobs
    assert lp is not None
    return {"token": lp.token, "logprob": lp.logprob, "bytes": list(lp.token.encode()),
            "top_logprobs": [{"token": text, "logprob": value, "bytes": list(text.encode())}
                             for _, text, value in lp.top]}

