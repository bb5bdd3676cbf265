"""The generic tool format's output, read as it is generated: text deltas in, tool events out.

A request with tools is constrained (``app.schemas.tools``) to answer with one JSON
object: ``{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}`` or
``{"response": ...}``. The OpenAI and Anthropic encoders stream that answer the way their
APIs do, a call's name first and then its arguments in fragments, so they need to know,
as each token's text arrives, where the generated text is: inside a call's ``name``, its
``arguments``, or the ``response``. ``ToolCallScanner.feed`` says so as events:

* ``CallStart(index, name)``: a call's name is complete (its arguments may follow);
* ``ArgumentsDelta(index, fragment)``: the next characters of its ``arguments`` value,
  exactly as generated, so the fragments joined are that value's JSON text;
* ``CallEnd(index)``: the call's object closed (or the output was cut, at ``end``);
* ``TextDelta(text)``: the answer's text: a string ``response`` decoded (escapes undone,
  a surrogate pair joined), or another ``response`` value's JSON text as it stands.

Why a scanner of its own: the fragments must be exact slices of the generated text, and
the partial JSON parsers (``jiter``'s partial mode, ``partial-json-parser``) return
values, not where in the text they lie; re-serialising a partial value is not a prefix of
the next one (a partial string gets a closing quote). This one tracks only what the task
needs (the containers open, the current key, whether it is in a string, an escape) and
does not validate: the constraint makes the text a valid prefix of one JSON document; on
text that is not, it still returns, with fewer events. Pure: no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_WS = " \t\r\n"
_SIMPLE_ESCAPE_CHARS = frozenset('"\\/bfnrt')


# The output events of every encoder's parser (``output_parser``), defined once here.


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Text of the answer's message (with its tokens' log-probabilities, as OpenAI writes
    them, when a plain-text parser was asked for them)."""

    text: str
    logprobs: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class CallStart:
    """A function call begins: its name is known, its arguments follow."""

    index: int
    name: str


@dataclass(frozen=True, slots=True)
class ArgumentsDelta:
    """A fragment of call ``index``'s arguments (JSON text)."""

    index: int
    fragment: str


@dataclass(frozen=True, slots=True)
class CallEnd:
    """Call ``index``'s object closed (or the output was cut)."""

    index: int


ToolEvent = TextDelta | CallStart | ArgumentsDelta | CallEnd


@dataclass(slots=True)
class ScannedCall:
    """One call as far as it was generated: its name and its arguments' JSON text."""

    name: str = ""
    arguments: str = ""
    started: bool = False  # CallStart was reported
    ended: bool = False


class _Frame:
    """An open container: an object (its current key) or an array (its item's index)."""

    __slots__ = ("index", "is_object", "key", "role")

    def __init__(self, is_object: bool, role: str | None) -> None:
        self.is_object = is_object
        self.key: str | None = None
        self.index = 0
        self.role = role  # what this container is: "calls", "call", or None


class ToolCallScanner:
    """Reads one answer in the generic tool format (the module docstring)."""

    def __init__(self) -> None:
        self._stack: list[_Frame] = []
        self._string: list[str] | None = None  # a key or name being read (raw)
        self._string_role: str | None = None  # "key", "name", "text", "raw" or None
        self._escape = ""  # an escape begun in a decoded string
        self._scalar = False  # inside a number or literal
        self._capture: tuple[str, int] | None = None  # ("args"|"text", its depth)
        self._events: list[ToolEvent] = []
        self.calls: list[ScannedCall] = []
        self._call: ScannedCall | None = None  # the call whose object is open

    @property
    def made_calls(self) -> bool:
        """Whether any call was started: the answer is a tool call, not text."""
        return any(call.started for call in self.calls)

    def feed(self, text: str) -> list[ToolEvent]:
        """The events ``text`` (the next characters of the answer) completes."""
        for ch in text:
            self._char(ch)
        return self._take()

    def end(self) -> list[ToolEvent]:
        """The output ended (maybe cut short): end the call still open, if any."""
        call = self._call
        if call is not None and not call.ended:
            self._start_call(call)
            call.ended = True
            self._events.append(CallEnd(self.calls.index(call)))
        return self._take()

    # -- the characters --------------------------------------------------------------

    def _char(self, ch: str) -> None:
        if self._string is not None:
            self._in_string(ch)
            return
        if self._scalar and (ch in _WS or ch in ",]}"):
            self._scalar = False
            self._value_ended()
        if self._capture is not None and not (ch in _WS and self._at_capture_depth()):
            self._raw(ch)
        if self._scalar or ch in _WS:
            return
        frame = self._stack[-1] if self._stack else None
        if ch == ",":
            if frame is not None:
                frame.key = None
                frame.index += 1
        elif ch == ":":
            pass
        elif ch in "}]":
            self._close()
        elif frame is not None and frame.is_object and frame.key is None and ch == '"':
            self._open_string("key")
        else:
            self._value_starts(ch)

    def _value_starts(self, ch: str) -> None:
        role = self._value_role()
        if role in ("args", "text") and self._capture is None and not (
                role == "text" and ch == '"'):
            self._capture = (role, len(self._stack))
            self._raw(ch)
        if ch == "{" or ch == "[":
            self._open(ch == "{", role)
        elif ch == '"':
            if role == "name":
                self._open_string("name")
            elif role == "text" and self._capture is None:
                self._open_string("text")
            else:
                self._open_string("raw")
        else:
            self._scalar = True

    def _open(self, is_object: bool, role: str | None) -> None:
        parent = self._stack[-1] if self._stack else None
        kind = None
        if role == "calls" and not is_object:
            kind = "calls"
        elif is_object and parent is not None and parent.role == "calls":
            kind = "call"
            self._call = ScannedCall()
            self.calls.append(self._call)
        self._stack.append(_Frame(is_object, kind))

    def _close(self) -> None:
        if not self._stack:
            return
        frame = self._stack.pop()
        if frame.role == "call" and self._call is not None:
            self._start_call(self._call)
            self._call.ended = True
            self._events.append(CallEnd(self.calls.index(self._call)))
            self._call = None
        self._value_ended()

    def _value_ended(self) -> None:
        """A value just ended at the current depth: a capture there is complete."""
        if self._capture is not None and self._capture[1] == len(self._stack):
            self._capture = None

    def _at_capture_depth(self) -> bool:
        return self._capture is not None and self._capture[1] == len(self._stack)

    def _value_role(self) -> str | None:
        """What the value starting now is, from the containers and key around it."""
        stack = self._stack
        if len(stack) == 1 and stack[0].is_object:
            return {"tool_calls": "calls", "response": "text"}.get(stack[0].key or "")
        if len(stack) == 3 and stack[2].role == "call":
            return {"name": "name", "arguments": "args"}.get(stack[2].key or "")
        return None

    # -- strings ---------------------------------------------------------------------

    def _open_string(self, role: str) -> None:
        self._string = []
        self._string_role = role
        self._escape = ""

    def _in_string(self, ch: str) -> None:
        role = self._string_role
        if self._capture is not None:
            self._raw(ch)
        assert self._string is not None
        if self._escape:
            self._escape += ch
            if self._escape_complete():
                self._string_char(self._escape)
                self._escape = ""
            return
        if ch == "\\":
            self._escape = ch
            return
        if ch == '"':
            self._string_ended(role)
            return
        self._string_char(ch)

    def _escape_complete(self) -> bool:
        esc = self._escape
        if len(esc) == 2 and esc[1] in _SIMPLE_ESCAPE_CHARS:
            return True
        if len(esc) == 6 and esc[1] == "u":
            # a high surrogate waits for its low half (12 characters in all)
            return not 0xD800 <= _hex(esc[2:6]) <= 0xDBFF
        return len(esc) >= 12 or (len(esc) >= 2 and esc[1] not in _SIMPLE_ESCAPE_CHARS
                                  and esc[1] != "u")

    def _string_char(self, raw: str) -> None:
        """One character of a string as written (an escape sequence whole)."""
        assert self._string is not None
        self._string.append(raw)
        if self._string_role == "text":
            self._events.append(TextDelta(_decode(raw)))

    def _string_ended(self, role: str | None) -> None:
        raw = "".join(self._string or ())
        self._string = None
        self._string_role = None
        frame = self._stack[-1] if self._stack else None
        if role == "key" and frame is not None:
            frame.key = _decode(raw)
            return
        if role == "name" and self._call is not None:
            self._call.name = _decode(raw)
            self._start_call(self._call)
        self._value_ended()

    # -- output ----------------------------------------------------------------------

    def _raw(self, ch: str) -> None:
        assert self._capture is not None
        if self._capture[0] == "text":
            self._events.append(TextDelta(ch))
            return
        call = self._call
        if call is None:
            return
        call.arguments += ch
        if call.started:
            self._events.append(ArgumentsDelta(self.calls.index(call), ch))

    def _start_call(self, call: ScannedCall) -> None:
        """Report the call's start, and the arguments read before its name, if any."""
        if call.started:
            return
        call.started = True
        index = self.calls.index(call)
        self._events.append(CallStart(index, call.name))
        if call.arguments:
            self._events.append(ArgumentsDelta(index, call.arguments))

    def _take(self) -> list[ToolEvent]:
        """The events since the last take, neighbours of one kind and call merged."""
        merged: list[ToolEvent] = []
        for event in self._events:
            last = merged[-1] if merged else None
            if isinstance(event, TextDelta) and isinstance(last, TextDelta):
                merged[-1] = TextDelta(last.text + event.text)
            elif (isinstance(event, ArgumentsDelta) and isinstance(last, ArgumentsDelta)
                  and last.index == event.index):
                merged[-1] = ArgumentsDelta(last.index, last.fragment + event.fragment)
            else:
                merged.append(event)
        self._events = []
        return merged


def _hex(digits: str) -> int:
    try:
        return int(digits, 16)
    except ValueError:
        return 0


def _decode(raw: str) -> str:
    """A JSON string's raw text (escapes as written) as the text it stands for."""
    try:
        value = json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return raw
    return value if isinstance(value, str) else raw
