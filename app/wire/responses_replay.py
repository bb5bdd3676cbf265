"""A background response's events, made again from its resumable stream's log.

A background response (``background: true``) runs as a resumable stream: the resume
registry logs its items as ``/v1/stream``'s native events (``resumable.py``), in memory
or in the shared Redis, whichever replica generates it. A reader of the response
(``GET /v1/responses/<id>?stream=true&starting_after=N``) gets the Responses events
instead: ``logged_item`` reads each logged event back into the stream item it was made
of, and ``ReplayedEvents`` feeds them to a ``ResponseEvents`` that skips the events up
to N. The Responses events are a pure function of the items and of the response object
as created (stored with the response), so every reader, on any replica, before or after
a failover, gets the same events with the same numbers.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from engine import FinishEvent, FinishReason, TokenEvent, TokenLogprobs
from streams import ErrorType

from .encoder import KEEPALIVE_COMMENT
from .resumable import TAKEN_OVER_EVENT

if TYPE_CHECKING:
    from streams import StreamItem
    from streams.resume import LoggedEvent

    from .responses_events import ResponseEvents


def logged_item(data: bytes) -> StreamItem | None:
    """The item a logged native event was made of; None for ``start`` (event 1) or an
    event this cannot read. ``done`` keeps its reason and usage (the native event has
    no error message: a failed finish reads as ``the request failed``)."""
    name, body = "", ""
    for line in data.decode("utf-8", "replace").split("\n"):
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            body += line[len("data: "):]
    try:
        fields: dict[str, Any] = json.loads(body) if body else {}
    except json.JSONDecodeError:
        return None
    if name == "token":
        return TokenEvent("", fields["index"], fields["id"], fields["text"],
                          _logprobs(fields.get("logprobs")))
    if name == "done":
        usage = fields.get("usage", {})
        reason = FinishReason(fields["finish_reason"])
        return FinishEvent("", reason, usage.get("prompt_tokens", 0),
                           usage.get("completion_tokens", 0),
                           error="the request failed" if reason is FinishReason.ERROR
                           else None, cached_tokens=usage.get("cached_tokens", 0))
    if name == "error":
        error = fields.get("error", {})
        try:
            kind = ErrorType(error.get("type"))
        except ValueError:
            kind = ErrorType.INTERNAL_ERROR
        # Imported here: ``StreamError`` lives beside ``TokenStream``, which loads Trio,
        # and ``app.wire`` (which exports this module) loads no Trio at import.
        from streams import StreamError

        return StreamError(kind, str(error.get("message", "")))
    return None


def _logprobs(data: dict[str, Any] | None) -> TokenLogprobs | None:
    if data is None:
        return None
    return TokenLogprobs(data["token"], data["logprob"],
                         tuple((t["id"], t["token"], t["logprob"]) for t in data["top"]))


def replay(events: ResponseEvents, logged: list[bytes]) -> bytes:
    """The events of ``logged`` (a whole log, event 1 first), through ``events``."""
    items = [item for item in map(logged_item, logged) if item is not None]
    return events.opening() + events.encode(_to_end(items))


def _to_end(items: list[StreamItem]) -> list[StreamItem]:
    """The items up to the terminal one (nothing is encoded after it)."""
    for i, item in enumerate(items):
        if not isinstance(item, TokenEvent):
            return items[: i + 1]
    return items


class ReplayedEvents:
    """``body.Encoder`` of a background response's logged events (``LoggedEvent``): each
    read back (``logged_item``; a live one's item as it is) and encoded by ``events``.
    No farewell (the response outlives its reader); a newer reader taking the stream
    over ends this one with an ``error`` event ``taken_over``."""

    def __init__(self, events: ResponseEvents) -> None:
        self.events = events
        self._over = False

    def opening(self) -> bytes:
        return self.events.opening()

    def encode(self, items: list[LoggedEvent]) -> bytes:
        out = []
        for logged in items:
            if self._over:
                break
            if logged.data == TAKEN_OVER_EVENT:
                self._over = True
                out.append(self.events.error(ErrorType.TAKEN_OVER.value,
                                             "another reader took this response over"))
                continue
            item = logged.item if logged.item is not None else logged_item(logged.data)
            if item is None:
                continue
            self._over = not isinstance(item, TokenEvent)
            out.append(self.events.encode([item]))
        return b"".join(out)

    def error(self, error_type: str, message: str) -> bytes:
        return b""

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT
