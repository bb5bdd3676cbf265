"""The one reader of a resumable stream on the replica that generates it.

A reader positioned after ``n`` first reads the log after ``n``, then takes live items
(each numbered and logged by the entry in the same step); while it holds the stream
nobody else takes any, so what it reads is gap-free. A newer reader takes it over
(``give_way``: its take in progress is cancelled, ``TokenStream.receive`` being
cancel-safe), and with a shared log a reader on another replica may take its lease,
which it finds at a renewal (every ``LEASE_CHECK_S``). Its ``close`` hands the stream
back to the registry (``on_close``, ``LocalStreams._detach``), which holds it for the
grace period, or until its ``run_until`` if later (a background response's hold); a
reader already taken over hands back nothing: the newer reader holds the stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

from .entry import ResumableStream
from .errors import TakenOver
from .log import SharedEventLog, StoreUnavailable
from .records import Holding, LoggedEvent

TAKEN_OVER = "a reader took the stream over"
# How long a takeover waits for the old reader's cancelled take to exit: one scheduling
# round in practice; the bound only keeps a starved loop from holding the new reader.
TAKEOVER_WAIT_S = 5.0
# How often a reader on the writer renews its lease while it reads (with a shared log),
# and so how soon it sees that a reader on another replica took the stream over: one
# round trip to the store a quarter second per stream read here, never one per event.
LEASE_CHECK_S = 0.25


class Reader:
    """The one reader of a resumable stream, positioned after event ``after``.

    Its owner (the response's connection) calls ``close()`` on every way out, which
    hands the stream back to the registry. Made by ``LocalStreams`` only.

    Args:
        token: its reader lease's token, with a shared log (``shared``).
        on_close: told once, at ``close``: the registry detaches the stream.
    """

    def __init__(
        self, entry: ResumableStream, after: int, token: str | None, *,
        shared: SharedEventLog | None, on_close: Callable[[Reader], None],
    ) -> None:
        self.entry = entry
        self.token = token
        self._pos = after
        self._shared = shared
        self._on_close = on_close
        self._pending: deque[bytes] = deque()
        self._closed = False
        self._taken_over = False
        self._take: tuple[trio.CancelScope, trio.Event] | None = None  # a take in progress
        self._attached = trio.Event()  # set when its attach is done (the old one let go)
        self._renewed_at = trio.current_time()

    @property
    def request_id(self) -> str:
        return self.entry.request_id

    def attached(self) -> None:
        """Its attach is done (the reader before it let go, or it failed)."""
        self._attached.set()

    def taken_over(self) -> None:
        """A newer reader took the stream over: the next ``receive`` raises TakenOver."""
        self._taken_over = True

    async def receive(self) -> LoggedEvent:
        """The next event: from the log while it has one after this reader's position,
        else the stream's next item, taken, logged and returned.

        Raises:
            trio.EndOfChannel: the stream ended and this reader has its last event.
            TakenOver: a newer reader took the stream over (here, or with a shared log
                on another replica: found at the lease's renewal).
            trio.ClosedResourceError: the reader was closed, or the stream cancelled.

        Cancellation: nothing to undo at every checkpoint, as ``TokenStream.receive``: an
        event leaves the log's pending list, or an item the stream, only when returned.
        A takeover cancels the take (only it) and the reader ends with ``TakenOver``. A
        cancel at the lease's renewal abandons the renewal (``_renew_lease``).
        """
        await trio.lowlevel.checkpoint()
        await self._renew_lease()
        entry = self.entry
        if self._taken_over:
            raise TakenOver(TAKEN_OVER)
        if self._closed or entry.holding is Holding.GONE:
            raise trio.ClosedResourceError("the resumable stream is gone")
        if not self._pending and self._pos < entry.last_n:
            self._pending.extend(entry.read_after(self._pos) or ())
        if self._pending:
            self._pos += 1
            return LoggedEvent(self._pos, self._pending.popleft(), None)
        while not entry.is_ended:
            done = trio.Event()
            with trio.CancelScope() as scope:
                self._take = scope, done
                try:
                    item = await entry.stream.receive()
                    # Invariant: no checkpoint between taking the item and logging it.
                    n, data = entry.log_item(item)
                finally:
                    self._take = None
                    done.set()
            if scope.cancelled_caught:
                raise TakenOver(TAKEN_OVER)  # only the takeover cancels this scope
            if n > self._pos:
                self._pos = n
                return LoggedEvent(n, data, item)
            # After a failover, an event this reader got from the dead writer before the
            # store had it: made again, the same bytes (the continuation is identical).
        raise trio.EndOfChannel

    async def _renew_lease(self) -> None:
        """With a shared log, every ``LEASE_CHECK_S``: renew this reader's lease, or find
        that a reader on another replica took it. Without an answer from the store, go
        on (as alone).

        Cancellation: abandoned, as its callee ``SharedEventLog.renew_reader`` is (a
        renewal changes nothing this reader must own, and waiting for a store that does
        not answer would hold its caller): the renewal may still land in the store, once,
        so the lease lapses within ``lease_s`` of it unless this reader's ``close`` lets
        it go first. The reader itself is unchanged: ``_renewed_at`` stays, so the next
        ``receive`` renews again."""
        log = self._shared
        if log is None or self.token is None or self._taken_over:
            return
        if trio.current_time() - self._renewed_at < min(LEASE_CHECK_S, log.lease_s / 3):
            return
        try:
            held = await log.renew_reader(self.request_id, self.token)
        except StoreUnavailable:
            held = True
        if not held:
            self._taken_over = True
        self._renewed_at = trio.current_time()

    async def give_way(self) -> bool:
        """A newer reader takes the stream over: mark this one taken over; wait, shielded
        and bounded, until its own attach is done and its take in progress (cancelled
        now) has exited. True once no take of it is left, False if the bound passed.

        Cancellation: finished first, shielded (bounded by ``TAKEOVER_WAIT_S``): the
        newer attach never leaves this reader half given over; the cancel reaches the
        caller afterwards.
        """
        self._taken_over = True
        with trio.CancelScope(shield=True, deadline=trio.current_time() + TAKEOVER_WAIT_S):
            await self._attached.wait()  # set already, but for a reader still attaching
            take = self._take
            if take is not None:
                take[0].cancel(reason=TAKEN_OVER)
                await take[1].wait()
        return self._attached.is_set() and self._take is None

    def close(self) -> None:
        """Let go of the stream: the registry holds it (the module docstring says for how
        long). Sync, idempotent, never a checkpoint."""
        if self._closed:
            return
        self._closed = True
        self._on_close(self)
