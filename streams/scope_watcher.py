"""One watcher of the scope: a bounded queue of frames that one SSE body reads.

A watcher is a stream like any other: its body reads it (``receive_batch``,
``take_ready``, ``nudge`` for the keep-alive timer, ``close``), and its queue is bounded
by the hub's policy (``policy.Policy``): at ``queue_limit`` frames it takes no more,
and each frame it could not take is dropped and counted (``missed``). A watcher can
hold nothing in the engine, so "pause" means missing frames: when its writer catches
up it gets a snapshot first (``snapshot`` from the feed: every open row, the recent
history) and then the live frames. Under a dropping policy a watcher still behind
after ``stall_timeout_s`` is ended with StreamError ``slow_client``, at the next frame
(a watcher costs nothing while no frame is made). The engine never waits for one.

Every method but the two waits is sync and never a checkpoint: the feed calls them in
the step path, and the body's ``__aexit__`` calls ``close`` in cancelled scopes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

from .error_type import ErrorType
from .policy import CAUGHT_UP, Policy
from .scope_types import ScopeFrame
from .stream import StreamError

ScopeItem = ScopeFrame | StreamError


class ScopeWatcher:
    """A watcher's queue (module docstring).

    Args:
        policy: the hub's: ``queue_limit`` and, if it drops, ``stall_timeout_s``.
        snapshot: builds a snapshot frame that reports ``missed`` frames.
        unsubscribe: called once, at close or when the watcher is dropped.
        tag: whose watcher it is (the app's key name), counted by ``ScopeFeed.watching``.
    """

    def __init__(self, policy: Policy, snapshot: Callable[[int], ScopeFrame],
                 unsubscribe: Callable[[ScopeWatcher], None], *,
                 tag: str | None = None) -> None:
        self.policy = policy
        self.tag = tag
        self._snapshot = snapshot
        self._unsubscribe = unsubscribe
        self._items: deque[ScopeItem] = deque()
        self._lag = CAUGHT_UP
        self._readable = trio.lowlevel.ParkingLot()
        self._nudged = False
        self._closed = self._ended = False
        self._behind = False  # frames were dropped: the next take starts with a snapshot
        self.missed = 0  # frames dropped because the queue was full, in all
        self.delivered = 0  # frames taken by the writer

    # -- the feed's side ---------------------------------------------------------------

    def put(self, frame: ScopeFrame, now: float) -> bool:
        """Queue ``frame``, or drop it if the queue is full; end a watcher overdue.
        Returns False once the watcher takes no more (ended or closed)."""
        if self._closed or self._ended:
            return False
        if len(self._items) >= self.policy.queue_limit:
            self.missed += 1
            self._behind = True
            self._lag = self.policy.after_put(self._lag, len(self._items), now)
            if self.policy.is_overdue(self._lag, now):
                self.end(StreamError(ErrorType.SLOW_CLIENT, (
                    f"the scope's reader stayed {self.policy.queue_limit} frames behind "
                    f"for {self.policy.stall_timeout_s} s")))
                return False
            return True
        self._items.append(frame)
        self._readable.unpark_all()
        return True

    def start_with_snapshot(self) -> None:
        """The writer's first take is a snapshot (a new page, or one the ring cannot
        bring up to date)."""
        self._behind = True

    def replay(self, frames: list[ScopeFrame]) -> None:
        """Queue the frames a reconnecting page missed (``Last-Event-ID``), before any
        live one; at most ``queue_limit`` (the feed gives a snapshot otherwise)."""
        self._items.extend(frames[-self.policy.queue_limit:])

    def end(self, error: StreamError) -> None:
        """End the watcher with ``error`` in place of its backlog; it leaves the feed."""
        if self._closed or self._ended:
            return
        self._ended = True
        self._items.clear()
        self._items.append(error)
        self._readable.unpark_all()
        self._unsubscribe(self)

    # -- the body's side -------------------------------------------------------------

    def take_ready(self, max_items: int) -> list[ScopeItem]:
        """The frames queued now (a snapshot first if frames were missed). Sync."""
        if self._closed:
            return []
        items: list[ScopeItem] = []
        if self._behind and not self._ended:
            self._behind = False
            self._items.clear()  # the snapshot says everything they did, and more
            items.append(self._snapshot(self.missed))
        while self._items and len(items) < max_items:
            items.append(self._items.popleft())
        self.delivered += len(items)
        if len(self._items) <= self.policy.low_water:
            self._lag = self.policy.after_take(self._lag, len(self._items))
        return items

    async def receive_batch(self, max_items: int) -> list[ScopeItem]:
        """The queued frames, waiting for one; [] when nudged (a keep-alive is due).

        Raises: trio.EndOfChannel after the terminal error; trio.ClosedResourceError
        once closed.

        Cancellation: nothing to undo: a frame leaves the queue only in the synchronous
        stretch that returns it.
        """
        self._nudged = False
        while True:
            if self._closed:
                raise trio.ClosedResourceError("the watcher was closed")
            items = self.take_ready(max_items)
            if items:
                return items
            if self._ended:
                raise trio.EndOfChannel
            if self._nudged:
                self._nudged = False
                return []
            await self._readable.park()

    def nudge(self) -> None:
        """Wake a waiting ``receive_batch`` with no items. Sync, never a checkpoint."""
        if self._readable.statistics().tasks_waiting:
            self._nudged = True
            self._readable.unpark_all()

    def close(self) -> None:
        """Leave the feed for good. Sync, idempotent, never a checkpoint."""
        if self._closed:
            return
        self._closed = True
        self._items.clear()
        self._readable.unpark_all()
        if not self._ended:
            self._unsubscribe(self)

    @property
    def queued(self) -> int:
        return len(self._items)
