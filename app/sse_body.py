"""The body of one ``text/event-stream`` response: a token stream turned into SSE bytes.

Owns the wire events of ``/v1/stream`` (their names, JSON data and ids), the keep-alive
comment, and the stream's ``close()`` on every way out of the body. Knows the stream only
as ``ItemSource`` (``streams.TokenStream`` satisfies it); knows no routes and no engine.

Events, with SSE ids counting events from 1 (keep-alive comments carry no id)::

    start  {"id": request id, "prompt_tokens": n}                      always first, id 1
    token  {"index": i, "id": token id, "text": delta}                 one per token
    done   {"finish_reason": "eos"|"length"|"stop",
            "usage": {"prompt_tokens": n, "completion_tokens": m}}     last, or
    error  {"error": {"type": "slow_client"|"engine_error"|"shutdown", "message": ...}}

Theory of operation
-------------------
Quart enters the body, iterates it (one ``__anext__`` per event, each written at once)
and exits it; ``__aexit__`` closes the stream on every way out of that block: the
terminal event was sent, a send raised, or ``trio.Cancelled`` (client gone, server
stopping) arrived at an await inside it (``docs/cancellation.md`` walks through the
disconnect path). It is an object, not an async generator, on purpose: a generator's ``finally``
runs only when the generator is finalised (later, and already cancelled), and Trio
forbids a ``yield`` inside a cancel scope, which the keep-alive needs.

Coalescing: ``__anext__`` takes every item queued by then (``TokenStream.receive_batch``)
and returns their events in one chunk, so one write carries them: a writer that keeps up
writes one event a write, one that lags (many streams, a fast engine) catches up in
fewer, larger writes instead of paying the response path's cost (Quart, hypercorn, h11,
the socket) once per event. Each item is still its own event with its own id.

Keep-alive: ``__anext__`` waits for the next items under ``trio.move_on_after(keepalive_s)``;
``TokenStream.receive_batch`` is cancel-safe (an item leaves the queue only when returned),
so a timeout loses nothing and yields a comment instead.

Cancellation: ``__anext__`` is cancelled only at ``receive_batch()``; the stream is
unchanged and ``__aexit__`` closes it.
"""

from __future__ import annotations

import json
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import trio
from quart.wrappers.response import ResponseBody

from engine import FinishEvent, TokenEvent
from streams import StreamError, StreamItem, encode_comment, encode_event

from .errors import ErrorType

if TYPE_CHECKING:
    from .metrics import RequestTimer

KEEPALIVE_COMMENT = encode_comment("keep-alive")
# Items one write carries at most: bounds a write's size (a stream's queue is bounded by
# its policy's limit anyway, or by max_new_tokens under ``unbounded``).
MAX_EVENTS_PER_WRITE = 64


class ItemSource(Protocol):
    """What the body needs of a stream; ``streams.TokenStream`` satisfies it."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_tokens(self) -> int: ...
    async def receive_batch(self, max_items: int) -> list[StreamItem]:
        """The queued items (at least one, at most ``max_items``), the terminal one last.
        Cancellation: must lose nothing (the keep-alive relies on it)."""
        ...

    def take_ready(self, max_items: int) -> list[StreamItem]:
        """The items queued now, maybe none; sync, no checkpoint."""
        ...

    def close(self) -> None: ...


def encode_json_event(event: str, event_id: int | str, data: dict[str, Any]) -> bytes:
    """One SSE event whose data is compact JSON.

    ``ensure_ascii`` escapes everything outside ASCII: clients whose line splitter is
    ``str.splitlines()`` (httpx's own ``LineDecoder``) would break a line at U+2028.
    """
    payload = json.dumps(data, ensure_ascii=True, separators=(",", ":"))
    return encode_event(payload, event=event, id=str(event_id))


def token_event(event_id: int, item: TokenEvent) -> bytes:
    """``encode_json_event("token", event_id, item_event(item)[1])``, byte for byte (a
    test checks it), built directly: the one event made once a token. The text is a JSON
    string escaped to ASCII, so the data is one line and needs no splitting."""
    text = json.dumps(item.text, ensure_ascii=True)
    return (f'event: token\nid: {event_id}\ndata: {{"index":{item.index},'
            f'"id":{item.token_id},"text":{text}}}\n\n').encode("ascii")


def start_event(request_id: str, prompt_tokens: int) -> tuple[str, dict[str, Any]]:
    """The ``start`` event's name and data."""
    return "start", {"id": request_id, "prompt_tokens": prompt_tokens}


def item_event(item: StreamItem) -> tuple[str, dict[str, Any]]:
    """A stream item's event name and data: ``token``, ``done`` or ``error``."""
    match item:
        case TokenEvent():
            return "token", {"index": item.index, "id": item.token_id, "text": item.text}
        case FinishEvent():
            return "done", {
                "finish_reason": item.reason.value,
                "usage": {
                    "prompt_tokens": item.prompt_tokens,
                    "completion_tokens": item.completion_tokens,
                },
            }
        case StreamError():
            return "error", error_data(item.type, item.message)
    raise TypeError(f"not a stream item: {item!r}")


def error_data(error_type: str, message: str) -> dict[str, Any]:
    return {"error": {"type": error_type, "message": message}}


class EventStreamBody(ResponseBody):
    """One stream's SSE body; give it to ``quart.Response`` with ``timeout = None``.

    Args:
        stream: the open stream; this body owns it from now on and closes it.
        keepalive_s: send a comment after this long without an event.
        timer: told of each item taken and of a farewell (``metrics.py``); the
            connection closes it.
    """

    def __init__(
        self,
        stream: ItemSource,
        *,
        keepalive_s: float,
        timer: RequestTimer | None = None,
    ) -> None:
        self.stream = stream
        self.timer = timer
        self.keepalive_s = keepalive_s
        self.is_entered = False  # quart entered the body: the status line has gone out
        self.is_finished = False  # the terminal event (done or error) was produced
        self._next_id = 1
        self._sent_start = False

    async def __aenter__(self) -> EventStreamBody:
        """Cancellation: no checkpoint; the body is entered or not."""
        self.is_entered = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the stream, on every way out. Cancellation: no checkpoint."""
        self.stream.close()

    def __aiter__(self) -> EventStreamBody:
        return self

    async def __anext__(self) -> bytes:
        """The next events' bytes (every item queued by now, see the module docstring),
        or a keep-alive comment after ``keepalive_s`` of quiet.

        Raises:
            StopAsyncIteration: after the terminal event, or if the stream was closed.

        Cancellation: raised at ``stream.receive_batch()`` with nothing taken.
        """
        if self.is_finished:
            raise StopAsyncIteration
        if not self._sent_start:
            self._sent_start = True
            opening = self._opening()
            if opening:
                return opening
        await trio.lowlevel.checkpoint_if_cancelled()  # before taking: a cancel loses nothing
        ready = self.stream.take_ready(MAX_EVENTS_PER_WRITE)
        if ready:  # catching up: no timeout scope, no schedule point (the write yields)
            return self._encode_all(ready)
        with trio.move_on_after(self.keepalive_s):
            try:
                items = await self.stream.receive_batch(MAX_EVENTS_PER_WRITE)
            except (trio.EndOfChannel, trio.ClosedResourceError):
                self.is_finished = True
                raise StopAsyncIteration from None
            return self._encode_all(items)
        return KEEPALIVE_COMMENT

    def _encode_all(self, items: list[StreamItem]) -> bytes:
        """The items' events, up to and including the terminal one (nothing after it)."""
        events = []
        for item in items:
            events.append(self._encode(item))
            if self.is_finished:
                break
        if self.timer is not None:
            self.timer.observe_all(items[: len(events)])
        return b"".join(events)

    def _opening(self) -> bytes:
        """The first event, before any item: ``start`` (empty for none)."""
        return self._event(*start_event(self.stream.request_id, self.stream.prompt_tokens))

    def farewell(self, error_type: ErrorType, message: str) -> bytes | None:
        """A last ``error`` event for a body cut off from outside (the server stops while
        the stream runs), or None if the body was never entered or already ended."""
        if not self.is_entered or self.is_finished:
            return None
        self.is_finished = True
        if self.timer is not None:
            self.timer.failed(error_type.value)
        return self._error(error_type.value, message)

    def _encode(self, item: StreamItem) -> bytes:
        if isinstance(item, TokenEvent):  # the hot path: one a token, by hand
            event_id, self._next_id = self._next_id, self._next_id + 1
            return token_event(event_id, item)
        name, data = item_event(item)
        if name != "token":
            self.is_finished = True
        return self._event(name, data)

    def _error(self, error_type: str, message: str) -> bytes:
        return self._event("error", error_data(error_type, message))

    def _event(self, name: str, data: dict[str, Any]) -> bytes:
        event_id, self._next_id = self._next_id, self._next_id + 1
        return encode_json_event(name, event_id, data)
