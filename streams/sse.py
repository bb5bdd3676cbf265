"""Server-sent events codec: bytes out for the server, bytes in for clients and tests.

This module owns the ``text/event-stream`` wire format and nothing else: it does no I/O,
knows nothing of Trio, HTTP, the hub or the engine, and never blocks. The writer
(:func:`encode_event`, :func:`encode_comment`) turns one event into UTF-8 bytes; the
parser (:class:`SSEParser`) turns bytes, fed in chunks of any size, into
:class:`ServerSentEvent` values, following every rule of
https://html.spec.whatwg.org/multipage/server-sent-events.html#event-stream-interpretation

Theory of operation (parser)
----------------------------
Bytes pass through three stages, each keeping its state across ``feed()`` calls, so the
chunking of the input never changes the result (a property test checks this):

1. Decoding. An incremental UTF-8 decoder (invalid bytes become U+FFFD) holds back an
   incomplete multi-byte character until its last byte arrives. A U+FEFF at the very
   start of the stream is a byte order mark and is dropped, once.
2. Line layer (:class:`_LineSplitter`). Only CRLF, CR and LF end a line; U+2028, U+0085
   and the other separators that ``str.splitlines()`` honours are ordinary data. A CR
   that ends one chunk may be the first half of a CRLF whose LF opens the next chunk, so
   the splitter remembers "the last character was CR" and then skips one leading LF.
   The line before the CR is emitted at once: a lone CR is a complete line ending.
3. Event layer (:meth:`SSEParser._process_line`). A blank line dispatches the buffered
   event; a line starting with ``:`` is a comment; any other line is a ``field:value``
   pair that updates the data, event type or last-event-id buffers, or the
   reconnection time.

   Invariant: every piece in the data buffer ends with LF, so the buffer is empty
   exactly when no ``data`` field has been seen since the last blank line.

At end of stream (:meth:`SSEParser.close`) whatever is buffered is discarded: the spec
dispatches an event only on its blank line, never on EOF.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

# The only line endings in an event stream (spec: "end-of-line = ( cr lf / cr / lf )").
# A regex alternation tries CRLF first, so a CRLF inside one chunk is one ending.
_LINE_END = re.compile(r"\r\n|\r|\n")
_BOM = "\ufeff"


@dataclass(frozen=True, slots=True)
class ServerSentEvent:
    """One dispatched event, as the parser reports it.

    Attributes:
        event: The event type; "message" when the stream gave none (or an empty one).
        data: The data fields joined with LF, without a trailing LF.
        id: The last event id in effect when the event was dispatched. Per the spec it
            persists across events, so an event without an ``id`` field carries the
            previous one; "" when no id has been set (or it was reset with ``id:``).
        retry: The reconnection time in milliseconds set by a valid ``retry`` field in
            this event's block, or None. The stream-wide value is
            :attr:`SSEParser.retry`.
    """

    event: str = "message"
    data: str = ""
    id: str = ""
    retry: int | None = None


def _split_text(text: str) -> list[str]:
    """Split on CRLF, CR or LF only: ``str.splitlines()`` would also split on U+2028."""
    return _LINE_END.split(text)


def encode_event(
    data: str,
    *,
    event: str | None = None,
    id: str | None = None,
    retry: int | None = None,
) -> bytes:
    """Encode one event as UTF-8 bytes, ending with the blank line that dispatches it.

    Fields are written in the order event, id, retry, data. Each line of ``data`` (split
    at CRLF, CR or LF) becomes its own ``data:`` field, so a parser rebuilds ``data``
    with every line ending normalised to LF. ``data=""`` still writes one ``data:``
    line: without it the parser would dispatch nothing.

    Args:
        data: The payload; any text.
        event: The event type, or None to leave it to the client's default "message".
        id: The last event id to set; "" resets the client's id. None writes no field.
        retry: The client's reconnection time in milliseconds, or None.

    Returns:
        The encoded event.

    Raises:
        ValueError: if ``event`` or ``id`` contains CR or LF (it would split the field
            and inject another), if ``id`` contains NUL (parsers ignore such an id), or
            if ``retry`` is negative (parsers accept only ASCII digits).
        TypeError: if ``retry`` is a bool.
    """
    lines: list[str] = []
    if event is not None:
        _check_single_line("event", event)
        lines.append(f"event: {event}")
    if id is not None:
        _check_single_line("id", id)
        if "\0" in id:
            raise ValueError(f"an SSE id must not contain NUL, got {id!r}")
        lines.append(f"id: {id}")
    if retry is not None:
        if isinstance(retry, bool):  # an int subclass: it would be written as "True"
            raise TypeError("retry must be an int, not a bool")
        if retry < 0:
            raise ValueError(f"retry must be a non-negative number of ms, got {retry!r}")
        lines.append(f"retry: {retry}")
    lines.extend(f"data: {line}" for line in _split_text(data))
    return ("\n".join(lines) + "\n\n").encode("utf-8")


def encode_comment(text: str = "") -> bytes:
    """Encode a comment, such as a keep-alive, as UTF-8 bytes: one ``:`` line per line.

    No blank line follows. By the spec a blank line after a comment dispatches nothing
    (the data buffer is empty between whole events), but httpx-sse 0.4.3 dispatches an
    empty ``message`` event at any blank line once an id has been seen, so a keep-alive
    with a blank line would reach its users as a spurious event. Comment lines alone still
    end at a line boundary, and whole events end with a blank line, so the writer's pieces
    may be concatenated in any order.

    Args:
        text: The comment; "" gives the shortest keep-alive, ``b":\\n"``.

    Returns:
        The encoded comment.
    """
    lines = [f": {line}" if line else ":" for line in _split_text(text)]
    return "".join(line + "\n" for line in lines).encode("utf-8")


def _check_single_line(field: str, value: str) -> None:
    if "\r" in value or "\n" in value:
        raise ValueError(f"an SSE {field} must not contain CR or LF, got {value!r}")


class _LineSplitter:
    """The line layer: text in, complete lines out, remembering a chunk-final CR."""

    def __init__(self) -> None:
        self._partial: list[str] = []  # the unterminated line so far, in pieces
        self._last_was_cr = False

    def split(self, text: str) -> list[str]:
        """Return the lines that ``text`` completes, without their line endings."""
        if not text:
            return []  # keep _last_was_cr: the LF may still come
        if self._last_was_cr and text[0] == "\n":
            text = text[1:]  # second half of a CRLF split across chunks
        self._last_was_cr = text.endswith("\r")
        pieces = _split_text(text)
        # Invariant: pieces[-1] is the unterminated rest ("" if text ended a line).
        if len(pieces) == 1:
            self._partial.append(pieces[0])
            return []
        lines = ["".join(self._partial) + pieces[0], *pieces[1:-1]]
        self._partial = [pieces[-1]] if pieces[-1] else []
        return lines


class SSEParser:
    """Incremental ``text/event-stream`` parser; see the module docstring.

    Attributes are read-only properties: :attr:`last_event_id` (what a reconnecting
    client sends as ``Last-Event-ID``) and :attr:`retry` (the last valid reconnection
    time in ms, or None).
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._at_start = True  # no character decoded yet, so a BOM may still come
        self._lines = _LineSplitter()
        self._data: list[str] = []  # Invariant: each piece ends with LF
        self._event_type = ""
        self._id_buffer = ""
        self._event_retry: int | None = None
        self._last_event_id = ""
        self._retry: int | None = None
        self._closed = False

    @property
    def last_event_id(self) -> str:
        """The last event id string; it persists across events, "" when none."""
        return self._last_event_id

    @property
    def retry(self) -> int | None:
        """The reconnection time in ms from the last valid ``retry`` field, or None."""
        return self._retry

    def feed(self, data: bytes) -> list[ServerSentEvent]:
        """Parse the next chunk of the stream.

        Args:
            data: Any number of bytes, including none; chunk boundaries may fall
                anywhere, even inside a UTF-8 character or a CRLF.

        Returns:
            The events that this chunk completed, in stream order (often none).

        Raises:
            RuntimeError: if called after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError("feed() after close()")
        text = self._decoder.decode(data)
        if self._at_start and text:
            self._at_start = False
            if text[0] == _BOM:
                text = text[1:]
        events = []
        for line in self._lines.split(text):
            event = self._process_line(line)
            if event is not None:
                events.append(event)
        return events

    def close(self) -> list[ServerSentEvent]:
        """End the stream, discarding any unfinished event and unterminated line.

        The spec dispatches only on a blank line, so this always returns []; it returns
        a list anyway so that callers can treat it like a final :meth:`feed`.
        Idempotent; :attr:`last_event_id` and :attr:`retry` stay readable.

        Returns:
            An empty list.
        """
        self._closed = True
        self._decoder.reset()
        self._lines = _LineSplitter()
        self._data.clear()
        self._event_type = ""
        self._event_retry = None
        return []

    def _process_line(self, line: str) -> ServerSentEvent | None:
        if not line:
            return self._dispatch()
        if line[0] == ":":
            return None  # a comment
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]  # only one space: "data:  x" has the value " x"
        if name == "data":
            self._data.append(value + "\n")
        elif name == "event":
            self._event_type = value
        elif name == "id" and "\0" not in value:
            self._id_buffer = value
        # Not str.isdigit() alone: it accepts "²" and "١", which are not ASCII digits.
        elif name == "retry" and value.isascii() and value.isdigit():
            self._retry = self._event_retry = int(value)
        # Any other field, an id with NUL and a retry that is not digits are ignored.
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        # The id buffer is copied even when nothing is dispatched, and never reset.
        self._last_event_id = self._id_buffer
        data = "".join(self._data)
        event_type, retry = self._event_type, self._event_retry
        self._data.clear()
        self._event_type = ""
        self._event_retry = None
        if not data:
            return None
        return ServerSentEvent(
            event=event_type or "message",
            data=data[:-1],  # the LF that the last data field appended
            id=self._last_event_id,
            retry=retry,
        )
