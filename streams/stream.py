"""One request's endpoint: the queue the hub fills, one task reads, and one close() ends.

A ``TokenStream`` owns a request's queue of items and its slow-reader state. It
knows the engine only through its ``StreamControl`` (the hub's ``OpenStreams``), and
knows nothing of HTTP or SSE: turning items into bytes is the app's job.

Theory of operation
-------------------
Ownership. ``Hub.open_stream`` creates and registers a stream once the engine has
accepted the request. From then on the stream belongs to the task that reads it:
the HTTP layer's per-request task, in its own nursery and cancel scope. That task
calls ``close()`` on every way out (``with stream:`` or ``finally``). The hub never
closes a stream; it can only *end* it by queueing a terminal item. Only ``close()``
unregisters, and only ``close()`` (or an end the hub makes) asks the engine to cancel.

    WAITING ──first token──> STREAMING ──terminal item queued──> ENDED ──close()──> CLOSED
       └──────── terminal item queued before any token ────────────>┘
    WAITING or STREAMING ──close()──> CLOSED      (client gone: the engine is asked to cancel)

Every way a stream ends (``StreamEnd`` says who causes each) reaches the same ``close()``:
the reader takes the terminal item, the next ``receive()`` raises ``trio.EndOfChannel``
and its ``finally`` closes; or ``trio.Cancelled`` unwinds through that same ``finally``.
(``docs/cancellation.md`` follows one disconnect from the socket through this ``close()``
to the freed block.)

Invariants:
- ``close()`` is synchronous, idempotent and never a checkpoint, so it runs in a
  cancelled scope and in a ``finally``.
- The terminal item (FinishEvent or StreamError) is the last item; anything the
  engine sends after it, or after close(), is refused here and counted by the hub.
- A StreamError the hub makes (slow_client, shutdown, engine_error after a failed
  step) replaces the unsent backlog: it is the next item the reader gets. One the
  engine reports for this sequence (FinishReason.ERROR) comes after the backlog.
- ``receive()`` has no checkpoint between taking an item and returning it, so a
  cancelled ``receive()`` loses nothing.

Writing. While items wait for a reader that keeps up, the hub holds back further steps'
events so that a lagging loop coalesces; the stream keeps that mark in its
``WriteMarks`` (``write_marks.py`` explains the chain from the socket to the stepper).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass
from typing import Protocol

import trio

from engine import FinishEvent, FinishReason, TokenEvent

from .error_type import ErrorType
from .policy import CAUGHT_UP, Lag, Policy
from .write_marks import WriteMarks, WritingControl


class StreamState(enum.Enum):
    """Where a stream is in its life; the engine's share of it is in each comment."""

    WAITING = "waiting"  # submitted; the engine holds it; no token yet (counts for max_waiting)
    STREAMING = "streaming"  # the engine generates; tokens flow into the queue
    ENDED = "ended"  # terminal item queued; the engine is done or asked to cancel
    CLOSED = "closed"  # close() ran: unregistered, queue discarded; nothing more happens


class StreamEnd(enum.Enum):
    """How a stream ended, recorded once, at the first of these:

    FINISHED     the engine sent FinishEvent (eos, length, stop); it is the last item
    CLIENT_GONE  close() before the engine was done: the reader's scope was cancelled
                 (the client disconnected) or it gave up; the engine is asked to cancel
    ERROR        the hub queued StreamError slow_client (the policy dropped a stalled
                 reader) or engine_error (a step failed, or the engine failed this
                 sequence), or the engine let the request go at its TTFT deadline
                 (deadline_missed); the engine is asked to cancel where it still holds it
    SHUTDOWN     the hub queued StreamError shutdown: the grace period of shutdown()
                 ran out, or the hub's own task was cancelled
    """

    FINISHED = "finished"
    CLIENT_GONE = "client_gone"
    ERROR = "error"
    SHUTDOWN = "shutdown"


@dataclass(frozen=True, slots=True)
class StreamError:
    """A terminal item: the stream ends without a FinishEvent."""

    type: ErrorType  # slow_client, engine_error, shutdown, resume_log_full, deadline_missed
    message: str


StreamItem = TokenEvent | FinishEvent | StreamError


@dataclass(frozen=True, slots=True)
class StreamStatistics:
    """A snapshot of one stream."""

    state: StreamState
    end: StreamEnd | None  # None until the stream ends
    queued: int  # items waiting for the reader
    delivered: int  # items the reader took
    discarded: int  # backlog thrown away when the hub queued a StreamError
    is_paused: bool  # the engine was asked to leave the sequence out of decode
    stall_deadline: float | None  # Trio time the reader is dropped unless it catches up


class StreamControl(WritingControl["TokenStream"], Protocol):
    """The hub as a stream sees it: what a stream asks of the hub that registered it
    (``open_streams.OpenStreams``); each call is sync, no checkpoint. Not the stream's
    owner: that is whoever closes it."""

    def pause(self, request_id: str) -> None: ...
    def resume(self, request_id: str) -> None: ...
    def cancel(self, request_id: str) -> None: ...
    def watch(self, deadline: float) -> None: ...
    def unregister(self, stream: TokenStream) -> None: ...


class TokenStream:
    """One request's items, read by one task. Made by ``Hub.open_stream`` only.

    Use as ``with hub.open_stream(request) as stream: async for item in stream: ...``
    or call ``close()`` in a ``finally``.
    """

    band: int = 0  # its request's priority band (engine.priority), which /scope shows

    def __init__(
        self, request_id: str, prompt_tokens: int, policy: Policy, control: StreamControl
    ) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens  # the engine's count, from submit()
        self.policy = policy
        self._control = control
        self._state = StreamState.WAITING
        self._end: StreamEnd | None = None
        self._lag = CAUGHT_UP
        self._items: deque[StreamItem] = deque()
        self._readable = trio.lowlevel.ParkingLot()  # the reader, waiting for an item
        self._nudged = False  # nudge() woke the reader: a receive_batch returns no items
        self._delivered = 0
        self._discarded = 0
        self._marks = WriteMarks(self, control)  # see "Writing" in the module docstring

    @property
    def state(self) -> StreamState:
        return self._state

    # -- the reader's side ------------------------------------------------------

    async def receive(self) -> StreamItem:
        """Take the next item, waiting for one if the queue is empty.

        Returns:
            A TokenEvent; or, last, a FinishEvent or a StreamError.

        Raises:
            trio.EndOfChannel: the terminal item was already taken.
            trio.ClosedResourceError: the stream was closed (before or while waiting).

        Cancellation:
            Nothing to undo, at every checkpoint: an item leaves the queue only in the
            synchronous stretch that returns it (``_take``), so a cancel, or a
            ``move_on_after(...)`` around this call, leaves it for the next call. The
            stream stays its owner's to close.
        """
        item = await self._receive(nudgeable=False)
        assert item is not None  # only a nudgeable receive returns None
        return item

    def nudge(self) -> None:
        """Wake a reader waiting in ``receive_batch`` with nothing for it: it returns no
        items (``streams.keepalive``: its writer sends a keep-alive). Sync, never a
        checkpoint; a no-op when no reader waits."""
        if self._readable.statistics().tasks_waiting:
            self._nudged = True
            self._readable.unpark_all()

    def write_blocked(self) -> None:
        """The writer's write waits for the client (``write_marks.py``): the hub no longer
        waits for this stream until the writer comes back. Sync, never a checkpoint."""
        self._marks.write_blocked()

    async def _receive(self, *, nudgeable: bool) -> StreamItem | None:
        if self._marks.blocked:  # the writer is back, for what was queued meanwhile
            self._marks.queued(keeps_up=bool(self._items) and self._lag == CAUGHT_UP
                               and self._state is not StreamState.CLOSED, back=True)
        if self._items or self._state in (StreamState.ENDED, StreamState.CLOSED):
            await trio.lowlevel.checkpoint()
        else:  # it will wait: the park below is its checkpoint (one schedule point less)
            self._marks.written()  # the reader is back for more and nothing waits
        self._nudged = False
        while True:
            if self._state is StreamState.CLOSED:
                raise trio.ClosedResourceError("the stream was closed")
            if self._items:
                return self._take()
            if self._state is StreamState.ENDED:
                raise trio.EndOfChannel
            if self._nudged and nudgeable:
                self._nudged = False
                return None
            await self._readable.park()

    def take_ready(self, max_items: int) -> list[StreamItem]:
        """The items queued now (at most ``max_items``; none: an empty list). Sync, never
        a checkpoint: for a writer that checks for cancellation itself before it takes
        (``trio.lowlevel.checkpoint_if_cancelled``) and will yield in its write, so that
        a writer catching up pays no schedule point and no timeout scope per write."""
        if self._state is StreamState.CLOSED:
            return []
        if self._marks.blocked:
            self._marks.queued(keeps_up=bool(self._items) and self._lag == CAUGHT_UP, back=True)
        items: list[StreamItem] = []
        while self._items and len(items) < max_items:
            items.append(self._take())
        return items

    async def receive_batch(self, max_items: int) -> list[StreamItem]:
        """Take every queued item (at most ``max_items``), waiting for one if none is.

        For a writer that lags behind the engine: what it missed goes out in one write
        (``app/routes/body.py``), each item still its own event. The policy sees the queue
        as one ``receive()`` per item would leave it at the end.

        Returns, raises and cancellation: as ``receive()``; the terminal item, if taken,
        is the last of the list. No items: ``nudge()`` woke it (a keep-alive is due).
        """
        first = await self._receive(nudgeable=True)
        if first is None:
            return []
        return [first, *self.take_ready(max_items - 1)]

    def close(self) -> None:
        """End the stream for good: unregister it, and cancel it in the engine unless
        the engine is already done with it. Synchronous, idempotent, never a checkpoint."""
        if self._state is StreamState.CLOSED:
            return
        engine_holds_it = self._state is not StreamState.ENDED
        if engine_holds_it:
            self._end = StreamEnd.CLIENT_GONE
        self._state = StreamState.CLOSED
        self._lag = CAUGHT_UP
        self._items.clear()
        self._readable.unpark_all()
        self._marks.written()
        try:
            if engine_holds_it:
                self._control.cancel(self.request_id)
        finally:
            self._control.unregister(self)

    async def aclose(self) -> None:
        """``close()``, then a checkpoint.

        Cancellation: closed by its owner, before the checkpoint: ``close()`` runs
        first, synchronously, so a cancel at the checkpoint finds the stream closed
        already (the engine asked to cancel, if it held it).
        """
        self.close()
        await trio.lowlevel.checkpoint()

    def __enter__(self) -> TokenStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __aiter__(self) -> TokenStream:
        return self

    async def __anext__(self) -> StreamItem:
        """The next item; StopAsyncIteration after the terminal one.

        Cancellation: nothing to undo: it is ``receive()``, whose item leaves the queue
        only when returned.
        """
        try:
            return await self.receive()
        except trio.EndOfChannel:
            raise StopAsyncIteration from None

    def statistics(self) -> StreamStatistics:
        return StreamStatistics(
            state=self._state,
            end=self._end,
            queued=len(self._items),
            delivered=self._delivered,
            discarded=self._discarded,
            is_paused=self._lag.is_paused,
            stall_deadline=self._lag.stall_deadline,
        )

    def _take(self) -> StreamItem:
        item = self._items.popleft()
        self._delivered += 1
        if self._state is not StreamState.ENDED:
            self._apply(self.policy.after_take(self._lag, len(self._items)))
        return item

    # -- the hub's side: synchronous, in the Trio thread --------------------------

    def deliver(self, event: TokenEvent | FinishEvent) -> bool:
        """Queue an engine event; False if the stream takes no more (the hub counts a drop)."""
        if self._state in (StreamState.ENDED, StreamState.CLOSED):
            return False
        if isinstance(event, TokenEvent):
            self._state = StreamState.STREAMING
            self._items.append(event)
            self._readable.unpark_all()
            self._apply(self.policy.after_put(self._lag, len(self._items), trio.current_time()))
            self._marks.queued(keeps_up=self._lag == CAUGHT_UP)
            return True
        elif event.reason is FinishReason.ERROR:  # the engine already released it
            message = event.error or "the engine failed this request"
            self._items.append(StreamError(ErrorType.ENGINE_ERROR, message))
            self._mark_ended(StreamEnd.ERROR)
        elif event.reason is FinishReason.DEADLINE:  # never ran: the engine holds nothing
            message = "the first token could not come before the request's deadline"
            self._items.append(StreamError(ErrorType.DEADLINE_MISSED, message))
            self._mark_ended(StreamEnd.ERROR)
        else:
            self._items.append(event)
            self._mark_ended(StreamEnd.FINISHED)
        self._marks.queued()
        return True

    def fail(self, error: StreamError, end: StreamEnd) -> bool:
        """End the stream with ``error`` in place of its backlog, and cancel it in the
        engine. False if it had already ended or closed."""
        if self._state in (StreamState.ENDED, StreamState.CLOSED):
            return False
        self._control.cancel(self.request_id)
        self._end_with(error, end)
        return True

    def drop_if_overdue(self, now: float) -> bool:
        """Drop a reader that stayed behind past its stall deadline; True if dropped."""
        if not self.policy.is_overdue(self._lag, now):
            return False
        message = (
            f"the reader stayed {self.policy.queue_limit} events behind "
            f"for {self.policy.stall_timeout_s} s"
        )
        return self.fail(StreamError(ErrorType.SLOW_CLIENT, message), StreamEnd.ERROR)

    def _end_with(self, error: StreamError, end: StreamEnd) -> None:
        self._discarded += len(self._items)
        self._items.clear()
        self._items.append(error)
        self._mark_ended(end)
        self._marks.written()  # ended from outside: not waited for (write_marks.py)

    def _mark_ended(self, end: StreamEnd) -> None:
        # A paused sequence needs no resume: the engine releases it (finish or cancel).
        self._state = StreamState.ENDED
        self._end = end
        self._lag = CAUGHT_UP
        self._readable.unpark_all()

    def _apply(self, lag: Lag) -> None:
        old, self._lag = self._lag, lag
        if lag.is_paused and not old.is_paused:
            self._control.pause(self.request_id)
        elif old.is_paused and not lag.is_paused:
            self._control.resume(self.request_id)
        if lag.stall_deadline is not None and lag.stall_deadline != old.stall_deadline:
            self._control.watch(lag.stall_deadline)
