"""The one body of every ``text/event-stream`` response: a source, an encoder, the
keep-alive, one farewell.

Every streaming route answers with ``EventStreamBody``: ``/v1/stream`` (the native
events), ``/v1/completions`` and ``/v1/chat/completions`` with ``"stream": true`` (OpenAI's
chunks), a resumable stream's readers (``resumable.py``), the lab's padded stream. Only
its two parts differ:

* the source: what it reads, ``streams.TokenStream`` (or anything ``ItemSource``
  describes), or a resumable stream's reader as ``resume_source.ResumeSource``;
* the encoder: what turns the items into bytes (``Encoder``: the opening, a batch of
  items, the failure event after the first byte, the keep-alive): ``app.wire``'s
  encoders, or ``resume_source.LoggedEvents`` for the events a reader gets logged.

Theory of operation
-------------------
Quart enters the body, iterates it (one ``__anext__`` per chunk, each written at once)
and exits it; ``__aexit__`` closes the source on every way out of that block: the
terminal item was sent, a send raised, or ``trio.Cancelled`` (client gone, server
stopping) arrived at an await inside it (``docs/cancellation.md`` walks through the
disconnect path). It is an object, not an async generator, on purpose: a generator's
``finally`` runs only when the generator is finalised (later, and already cancelled),
and Trio forbids a ``yield`` inside a cancel scope, which the keep-alive needs.

Coalescing: ``__anext__`` takes every item queued by then (``take_ready``, sync, no
timeout scope and no schedule point: the write yields) and returns their bytes in one
chunk, so one write carries them: a writer that keeps up writes one event a write, one
that lags (many streams, a fast engine) catches up in fewer, larger writes instead of
paying the response path's cost (Quart, hypercorn, h11, the socket) once per event.
Each item is still its own event with its own id.

Keep-alive: with nothing queued, ``__anext__`` waits for the next items, and after
``keepalive_s`` of quiet yields the encoder's keep-alive instead. A source that can be
nudged (``streams.TokenStream``) is timed by the app's one keep-alive timer
(``streams.Keepalives``, given as ``keepalives``): the body says it waits, and a nudge
makes ``receive_batch`` return no items, with no timeout scope around the wait (one
cost as much as a write: ``streams/keepalive.py``). Any other source (a resumable
stream's reader), or a body without the timer, waits under ``trio.move_on_after
(keepalive_s)``; ``receive_batch`` is cancel-safe (an item leaves the queue only when
returned), so a timeout loses nothing. A source that must await something before it
reads on (a resumable stream's failover) raises ``SourceMoved``; the body awaits it out
of the keep-alive's scope, whose timer must not cancel it.

Farewell: when the server cuts a stream (hypercorn's graceful timeout),
``app.edge.connection`` asks the body for ``farewell`` and writes it, shielded and
bounded: the encoder's failure event, once, unless the body never started or ended.

Cancellation: nothing to undo in ``__anext__``, cancelled only at ``receive_batch()`` (or a
failover's attach), where the source takes no item it does not return; the source is
closed by its owner, ``__aexit__`` (or the connection's backstop).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, cast

import trio
from quart.wrappers.response import ResponseBody

from engine import TokenEvent
from streams import ScopeFrame
from streams.resume import LoggedEvent

from ..wire import ChoiceFinish, Encoder

if TYPE_CHECKING:
    from streams import Keepalives

    from ..errors import ErrorType
    from ..metrics import RequestTimer

# Items one write carries at most: bounds a write's size (a stream's queue is bounded by
# its policy's limit anyway, or by max_new_tokens under ``unbounded``).
MAX_EVENTS_PER_WRITE = 64

Item = TypeVar("Item")  # a StreamItem, or a resumable stream's LoggedEvent
# An item of these types never ends a stream: a token, a resumable stream's logged event
# (its reader says when the stream is over), a frame of the scope (``scope.py``), one
# choice's end while others go on (``choices.py``). Any other (a finish, an error) does.
_CONTINUING = frozenset({TokenEvent, LoggedEvent, ScopeFrame, ChoiceFinish})


class ItemSource(Protocol[Item]):
    """What the body reads; ``streams.TokenStream`` satisfies it."""

    async def receive_batch(self, max_items: int) -> list[Item]:
        """The queued items (at least one, at most ``max_items``), the terminal one last.

        Raises: trio.EndOfChannel or trio.ClosedResourceError at the end; SourceMoved.
        Cancellation: nothing to undo, required of every source: an item leaves it only
        in the synchronous stretch that returns it, because the keep-alive's timeout
        cancels this call whenever the stream is quiet for ``keepalive_s``.
        """
        ...

    def take_ready(self, max_items: int) -> list[Item]:
        """The items queued now, maybe none; sync, no checkpoint."""
        ...

    def close(self) -> None: ...


class NudgeableSource(ItemSource[Item], Protocol[Item]):
    """A source the keep-alive timer can nudge: its ``receive_batch`` then returns []."""

    def nudge(self) -> None: ...


class SourceMoved(Exception):
    """Raised by a source's ``receive_batch`` that must await ``move`` before it reads
    on (a resumable stream whose owner died is attached again: failover)."""

    def __init__(self, move: Callable[[], Awaitable[None]]) -> None:
        super().__init__("the source moved")
        self.move = move


class EventStreamBody(ResponseBody, Generic[Item]):
    """One stream's SSE body; give it to ``quart.Response`` with ``timeout = None``.

    Args:
        source: what it reads; this body owns it from now on and closes it.
        encoder: the wire format (see the module docstring).
        keepalive_s: send the encoder's keep-alive after this long without an item.
        keepalives: the app's keep-alive timer (``keepalive_s`` must be its interval);
            used if ``source`` can be nudged, else (or None) a timeout scope per wait.
        timer: told of each item taken and of a farewell (``metrics.py``); the
            connection closes it.
    """

    def __init__(
        self,
        source: ItemSource[Item],
        encoder: Encoder[Item],
        *,
        keepalive_s: float,
        keepalives: Keepalives | None = None,
        timer: RequestTimer | None = None,
    ) -> None:
        self.source = source
        self.encoder = encoder
        self.timer = timer
        self.keepalive_s = keepalive_s
        self.is_entered = False  # quart entered the body: the status line has gone out
        self.is_finished = False  # the terminal item was encoded (or the source ended)
        self._opened = False
        self._keepalive = encoder.keepalive()
        self.keepalives = keepalives
        nudgeable = keepalives is not None and callable(getattr(source, "nudge", None))
        self._keepalives = keepalives if nudgeable else None  # None: a scope per wait

    async def __aenter__(self) -> EventStreamBody[Item]:
        """Cancellation: nothing to undo, as none can land: no checkpoint; the body is
        entered or not."""
        self.is_entered = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Close the source, on every way out. Cancellation: closed by its owner: this is
        the owner's close, with no checkpoint, so it runs whole in a cancelled scope."""
        self.source.close()

    def __aiter__(self) -> EventStreamBody[Item]:
        return self

    async def __anext__(self) -> bytes:
        """The next items' bytes (every item queued by now, see the module docstring),
        or a keep-alive after ``keepalive_s`` of quiet.

        Raises:
            StopAsyncIteration: after the terminal item, or if the source ended.

        Cancellation: nothing to undo: it lands at ``source.receive_batch()``, which
        takes nothing it does not return; the source is closed by its owner (``__aexit__``,
        or the connection's backstop).
        """
        if self.is_finished:
            raise StopAsyncIteration
        if not self._opened:
            self._opened = True
            opening = self.encoder.opening()
            if opening:
                return opening
        await trio.lowlevel.checkpoint_if_cancelled()  # before taking: a cancel loses nothing
        ready = self.source.take_ready(MAX_EVENTS_PER_WRITE)
        if ready:  # catching up: no timeout scope, no schedule point (the write yields)
            return self._encode(ready)
        if self._keepalives is not None:
            return await self._wait_timed(self._keepalives)
        moved: SourceMoved | None = None
        with trio.move_on_after(self.keepalive_s):
            try:
                items = await self.source.receive_batch(MAX_EVENTS_PER_WRITE)
            except SourceMoved as exc:
                moved = exc
            except (trio.EndOfChannel, trio.ClosedResourceError):
                self.is_finished = True
                raise StopAsyncIteration from None
            else:
                return self._encode(items)
        if moved is not None:  # out of the keep-alive's scope: its timer cancels nothing
            await moved.move()
        return self._keepalive

    async def _wait_timed(self, keepalives: Keepalives) -> bytes:
        """Wait for items with the app's keep-alive timer: no items is a nudge."""
        source = cast("NudgeableSource[Item]", self.source)
        keepalives.waiting(source)
        try:
            items = await source.receive_batch(MAX_EVENTS_PER_WRITE)
        except (trio.EndOfChannel, trio.ClosedResourceError):
            self.is_finished = True
            raise StopAsyncIteration from None
        finally:
            keepalives.back(source)
        return self._encode(items) if items else self._keepalive

    def _encode(self, items: list[Item]) -> bytes:
        """The items' bytes, up to and including the terminal one (nothing after it)."""
        for i, item in enumerate(items):
            if type(item) not in _CONTINUING:
                self.is_finished = True
                items = items[: i + 1]
                break
        if self.timer is not None:  # a stream's items; a choice's end is not the request's
            self.timer.observe_all([i for i in items if type(i) is not ChoiceFinish])  # type: ignore[misc]
        return self.encoder.encode(items)

    def farewell(self, error_type: ErrorType, message: str) -> bytes | None:
        """A last failure event for a body cut off from outside (the server stops while
        the stream runs), or None if the body was never entered or already ended, or
        its encoder has none (a resumable stream outlives this response)."""
        if not self.is_entered or self.is_finished:
            return None
        last = self.encoder.error(error_type.value, message)
        if not last:
            return None
        self.is_finished = True
        if self.timer is not None:
            self.timer.failed(error_type.value)
        return last
