"""Tool calls in a model's own format, read as they are generated: the same events as the
generic format's scanner.

A request whose model's chat template renders ``tools`` is answered in that family's
syntax (``app.schemas.tool_formats``, which also constrains it): Hermes and Qwen 2.5's
``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks after any text,
Llama 3.1's ``{"name": ..., "parameters": ...}`` calls joined by ``"; "``, Mistral's
``[TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]``. The encoders stream every answer
the same way, a call's name and then its arguments' fragments, from the events of
``tool_call_scanner.ToolCallScanner``; ``FormatScanner`` yields exactly those events for a
family's syntax, so no encoder knows which format it reads. ``tool_scanner(tools)`` is the
one place a scanner is chosen: the encoders' ``tools`` is False (no tools), True (the
generic format) or a format's name.

How: text comes first, as ``TextDelta``s, until the family's marker (Hermes: anywhere in
the text, held back while the text's end may be the marker's start; Llama and Mistral:
only at the start of the answer, so an answer that does not start with it is text to the
end). From the marker on, every JSON object at the top level is a call, and the rest
(the framing: ``</tool_call>``, ``; ``, the list's brackets) is dropped; each call's
characters go to the generic scanner as though they were items of its ``{"tool_calls":
[...]}``, with the family's arguments key for ``arguments``. Like that scanner this one
does not validate (the constraint makes the text a prefix of the format) and, on text
that is not, still returns, with fewer events. Pure: no I/O. The format names are
``app.schemas.tool_formats``'s (a test checks that both know the same).
"""

from __future__ import annotations

from dataclasses import dataclass

from .tool_call_scanner import TextDelta, ToolCallScanner, ToolEvent


@dataclass(frozen=True, slots=True)
class CallSyntax:
    """What the reader needs of a family's syntax.

    Args:
        arguments_key: the key of a call's arguments in its JSON object.
        markers: what starts the calls, each with whether it is the first call's own
            first character (Llama's ``{``) rather than framing to drop.
        anywhere: the marker may follow text (Hermes); else only the answer's start.
    """

    arguments_key: str
    markers: tuple[tuple[str, bool], ...]
    anywhere: bool


SYNTAXES: dict[str, CallSyntax] = {
    "hermes": CallSyntax("arguments", (("<tool_call>", False),), anywhere=True),
    "llama3_json": CallSyntax("parameters", (("<|python_tag|>", False), ("{", True)),
                              anywhere=False),
    "mistral": CallSyntax("arguments", (("[TOOL_CALLS]", False),), anywhere=False),
}


def tool_scanner(tools: bool | str | None) -> ToolCallScanner:
    """The reader of an answer with ``tools``: True, the generic format; a format's
    name (``SYNTAXES``), that family's; anything else, the generic format."""
    syntax = SYNTAXES.get(tools) if isinstance(tools, str) else None
    return ToolCallScanner() if syntax is None else FormatScanner(syntax)


class FormatScanner(ToolCallScanner):
    """Reads one answer in a family's syntax (the module docstring)."""

    def __init__(self, syntax: CallSyntax) -> None:
        super().__init__()
        self._syntax = syntax
        self._mode = "text"  # "text" (the marker may come), "plain" (it cannot), "calls"
        self._pending = ""  # text held back: it may be the marker's start
        self._depth = 0  # containers open in the current call's JSON
        self._quoted = False  # inside a string of the call's JSON
        self._escaped = False
        self._in_list = False  # the generic scanner was given its ``{"tool_calls": [``

    def feed(self, text: str) -> list[ToolEvent]:
        """The events ``text`` (the next characters of the answer) completes."""
        for ch in text:
            if self._mode == "calls":
                self._call_char(ch)
            elif self._mode == "plain":
                self._events.append(TextDelta(ch))
            else:
                self._text_char(ch)
        return self._take()

    def end(self) -> list[ToolEvent]:
        """The output ended (maybe cut short): the text held back is text; the call
        still open, if any, ends."""
        if self._pending:
            self._events.append(TextDelta(self._pending))
            self._pending = ""
        return super().end()

    def _value_role(self) -> str | None:
        stack = self._stack
        if len(stack) == 3 and stack[2].role == "call":
            return {"name": "name", self._syntax.arguments_key: "args"}.get(stack[2].key or "")
        return super()._value_role()

    # -- before the calls ------------------------------------------------------------

    def _text_char(self, ch: str) -> None:
        self._pending += ch
        if self._syntax.anywhere:
            self._text_anywhere()
        else:
            self._text_at_start()

    def _text_anywhere(self) -> None:
        """Text until the marker; the text's end is held while it may begin it."""
        (marker, _), = self._syntax.markers
        pending = self._pending
        at = pending.find(marker)
        if at >= 0:
            self._text(pending[:at])
            self._pending = ""
            self._mode = "calls"
            return
        held = next((n for n in range(min(len(marker) - 1, len(pending)), 0, -1)
                     if marker.startswith(pending[-n:])), 0)
        self._text(pending[:len(pending) - held])
        self._pending = pending[len(pending) - held:]

    def _text_at_start(self) -> None:
        """Calls if the answer starts with a marker (after blanks), else text to the end."""
        head = self._pending.lstrip()
        for marker, is_json in self._syntax.markers:
            if head.startswith(marker):
                self._pending = ""
                self._mode = "calls"
                for ch in head[0 if is_json else len(marker):]:
                    self._call_char(ch)
                return
        if not any(marker.startswith(head) for marker, _ in self._syntax.markers):
            self._text(self._pending)
            self._pending = ""
            self._mode = "plain"

    def _text(self, text: str) -> None:
        if text:
            self._events.append(TextDelta(text))

    # -- the calls -------------------------------------------------------------------

    def _call_char(self, ch: str) -> None:
        """One character after the marker: a call's JSON, or framing (dropped)."""
        if self._depth == 0:
            if ch != "{":
                return
            for framing in ('{"tool_calls": [' if not self._in_list else ", "):
                self._char(framing)
            self._in_list = True
        self._char(ch)
        if self._quoted:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._quoted = False
        elif ch == '"':
            self._quoted = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
