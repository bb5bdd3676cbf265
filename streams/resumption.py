"""Resumable streams: who owns a stream whose reader left, and how the next reader takes it.

The registry keeps, for each resumable stream, its ``TokenStream`` and a log of its
encoded events (``resume_log.EventLog``), so a reader that comes back with the number
of the last event it got replays the rest and then follows live. It knows nothing of
HTTP: the app gives it an encoder (``(n, item) -> bytes``) and serves its readers.

Theory of operation
-------------------
Exactly one task takes a resumable stream's items, logs them and, while attached,
writes them: the task that owns the stream. Ownership changes hands in two places
only, ``Reader.close`` (detach) and ``ResumeRegistry.attach`` (take over)::

    ATTACHED: a reader's task (its connection's nursery) takes each item, logs it,
      │       writes it; the connection owns the Reader, whose close() runs on every
      │       way out of the response
      │ Reader.close(): sync, never a checkpoint (it runs in the cancelled scope of a
      │ client that left): start a holder task in the registry's nursery, under a
      ▼ cancel scope whose deadline is now + grace_s
    DETACHED: the holder takes each item and logs it (the engine does not wait for it);
      │       after the last item it keeps the log until the deadline
      ├── attach(): mark the holder taken over, cancel its scope ("a reader took the
      │   stream over"), wait (shielded; it has no await left but its cancelled one)
      │   for it to exit, and return a Reader: ATTACHED again, no item lost or doubled
      ├── the deadline passes: the holder closes the stream (the engine is asked to
      │   cancel, exactly as when a client leaves a plain stream: blocks released
      │   once) and expires the log: later readers get nothing (the app says 204)
      └── cancel() (DELETE) or the registry stopping: the same, at once

Numbering: event 1 is the opening (the app's ``start``); each item taken is the next
number, assigned and logged with no checkpoint between taking and logging, so the log
has every event exactly once, in order. A reader positioned after ``n`` first reads
the log after ``n``, then takes live items; while it holds the stream nobody else
takes any, so what it reads is gap-free.

One reader at a time, the newest: ``attach`` while a reader holds the stream takes it
over. The server cannot tell a reader whose connection died silently (no FIN, no RST:
a phone that changed networks) from a live one, so the newcomer wins: the old reader is
marked taken over, its take in progress (if any) is cancelled (``TokenStream.receive``
is cancel-safe: nothing is lost) and ``attach`` waits, shielded and bounded
(``TAKEOVER_WAIT_S``), for that take to exit, as it waits for a detached holder; so
one task takes items at a time and the new reader's log-then-live reading is gap-free.
The old reader's next ``receive`` raises ``TakenOver`` (it gets no more events); its
``close`` changes nothing. A take that does not exit within the bound (a starved loop)
gives ``ReaderBusy`` instead, and the old reader still ends at its next ``receive``.

Memory: a stream's log holds at most its own events (the opening, at most
``max_new_tokens`` tokens, one last event). The bytes of detached streams (running or
finished) are capped server-wide (``max_detached_bytes``): a detached stream whose next
event would pass the cap is ended instead, with a StreamError ``resume_log_full`` as its
last event (the one event allowed past the cap) and the engine asked to cancel it; a
finished log that would pass the cap when its reader leaves is expired at once (later
readers get nothing). Only the first is counted, in ``overflows``. A log is kept after
the stream ended until the grace period after its last reader left, for a reader whose
connection broke before the last event reached it.

Cancellation: the holders run in the registry's nursery (``run``); cancelling ``run``
cancels them, and each closes its stream (the engine is asked to cancel) and expires
its log on the way out.

Several replicas (a ``SharedEventLog``: Redis, ``redis_log.py``): the replica whose engine
generates a stream owns it, exactly as above, and its log also goes to the store. A
reader that comes back to another replica (the balancer chose it) gets a
``RemoteReader``: it replays the store after its position and follows it (blocking
reads) until the event marked last. Every reader, here or there, holds the stream's
reader lease (a key with a time to live, renewed while it is held; the owner's writer
task renews its own readers' too). A new reader, here or there, takes the lease over
(it sets the lease to its own token); the old reader learns it at its next renewal
(a remote reader before each read of the store, a reader on the owner every
``LEASE_CHECK_S`` while it reads) and ends with ``TakenOver``: on the owner it then
lets go of the stream, which its holder takes (no item lost: the new reader follows
the shared log the owner writes). The owner, meanwhile, holds the stream DETACHED;
when the grace period runs out it looks at the lease, and while a remote reader holds
it the stream goes on for another grace period. Without an answer from the store, the
owner goes on as if alone.

Failover. The owner publishes, with a new stream's first event, what a rebuild needs
(``adopt(spec=...)``: the app's request, prompt token ids and seed) and holds an owner
lease that its log renews until the stream's last event. A resume on another replica
of a stream that has not ended, whose owner lease lapsed (the owner died), takes the
stream over in one atomic operation of the store (``take_over``: exactly one replica
wins; a loser follows the log as a remote reader), reads the spec and every event, and
calls the app's ``rebuild``, which opens the stream again continuing after those events
and hands it to this registry in the same call: from then on this replica owns it,
appending to the same log with the next numbers, so readers anywhere go on with the same
event ids. A remote reader whose read comes back empty while the owner lease is gone
raises ``OwnerGone`` with its position; the app attaches again there, in the same
response, which takes the stream over. A resume positioned past the store's last event
(the dead owner sent its reader events its writer never stored) waits for the owner
lease to lapse instead of failing, and the takeover makes those events again.

A replica that drains (``drain()``, at SIGTERM) is going away, and its remote readers
only follow a log that another replica writes: each ends at once, at its next event,
its body with no final event (the client resumes: the balancer now sends it to another
replica, which follows the same log), and a resume of another replica's stream here is
refused with ``Draining`` (503, ``Retry-After``). Its own streams go on as the hub's
drain lets them; a reader may still resume one here, from the local log. Shortly before
the drain's deadline, those still running are handed over instead of ending with
``shutdown`` (``hand_over``): each is closed here (the engine is asked to cancel it, as
for a client gone), forgotten here only (its keys in the store stay), and once every
event it logged is in the store its owner lease is let go (compare-and-delete, in the
same ordered batches), so a resume on another replica takes it over at once and
continues it with the same tokens, as after a death. Its reader here, if any, ends
without a final event, like the remote readers the drain cut: the client resumes.
"""

from __future__ import annotations

import contextlib
import enum
import math
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from engine import FinishEvent

from .resume_log import EventLog, SharedEventLog, StoreUnavailable
from .stream import ErrorType, StreamError, StreamItem, TokenStream

Encode = Callable[[int, StreamItem], bytes]
TAKEN_OVER = "a reader took the stream over"
# How long a takeover waits for the old reader's cancelled take to exit: one scheduling
# round in practice; the bound only keeps a starved loop from holding the new reader.
TAKEOVER_WAIT_S = 5.0
# How often a reader on the owner renews its lease while it reads (with a shared log),
# and so how soon it sees that a reader on another replica took the stream over: one
# round trip to the store a quarter second per stream read here, never one per event.
LEASE_CHECK_S = 0.25
# How long a reader on another replica waits for the shared log to reach the position
# it claims (the owner's writer task lags its live readers by a batch).
POSITION_WAIT_S = 2.0
# How long one read of the store waits for it to reach a position, between looks at the
# owner lease (a takeover may be due): a tenth of a second, a few round trips a second
# for the few seconds at most that a reader waits there.
POSITION_STEP_S = 0.1


class Observer(Protocol):
    """Told of every item logged (the app's metrics timer); closed when forgotten."""

    def observe(self, item: StreamItem) -> None: ...
    def close(self) -> None: ...


# What a rebuild hands its new stream to, in the same call that opens it (no checkpoint).
Adopt = Callable[[TokenStream, Encode, "Observer | None"], None]


class Rebuild(Protocol):
    """The app's side of a failover: open the stream again from its ``spec`` (what
    ``adopt(spec=...)`` published) and its ``events`` so far (n, data, last), continuing
    after them, and hand it to ``adopt`` as it opens. Raises what opening raises."""

    async def __call__(self, request_id: str, spec: bytes,
                       events: list[tuple[int, bytes, bool]], adopt: Adopt) -> None: ...


class ResumeError(Exception):
    """A reader cannot attach; the subclass says why."""


class NothingToResume(ResumeError):
    """The stream is unknown or expired, or it ended and the reader has every event."""


class ReaderBusy(ResumeError):
    """The old reader did not let go within ``TAKEOVER_WAIT_S`` (try again)."""


class TakenOver(trio.ClosedResourceError):
    """A newer reader took the stream over: this reader gets no more events."""


class OwnerGone(trio.ClosedResourceError):
    """The replica generating the stream a ``RemoteReader`` follows died (its owner
    lease lapsed): an ``attach`` after ``position`` takes the stream over (failover)."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position


class BadPosition(ResumeError):
    """The reader claims an event the stream has not made yet."""


class Draining(ResumeError):
    """This replica is draining: it follows no other replica's stream (resume elsewhere)."""


class Holding(enum.Enum):
    """Who takes a resumable stream's items now (see the module docstring)."""

    ATTACHED = "attached"  # a reader's task, in its connection's nursery
    DETACHED = "detached"  # a holder task in the registry's nursery, until the deadline
    GONE = "gone"  # forgotten: stream closed, log expired


@dataclass(frozen=True, slots=True)
class LoggedEvent:
    """One event a reader gets: its number, its bytes, and the item if it was live."""

    n: int
    data: bytes
    item: StreamItem | None  # None for a replayed event


@dataclass(frozen=True, slots=True)
class ResumeStatistics:
    """A snapshot of the registry; counters count since construction."""

    streams: int  # resumable streams held (running, or finished with their log kept)
    detached: int  # of which no reader holds
    log_bytes: int  # bytes in the logs of every stream held
    detached_bytes: int  # bytes in the logs of detached streams (capped)
    resumes: int  # readers that attached to an existing stream (a GET, not the POST)
    expiries: int  # grace periods that ran out (a running stream was then cancelled)
    overflows: int  # streams ended for the byte cap (resume_log_full)
    cancels: int  # streams ended by cancel() (DELETE)
    failovers: int = 0  # streams of a dead owner taken over and continued here
    disowned: int = 0  # streams of this replica another one took over (it had stalled)
    handed_over: int = 0  # streams left to another replica at a drain (hand_over)


class ResumableStream:
    """One resumable stream: its TokenStream, log position and holder. Made by
    ``ResumeRegistry.adopt`` only."""

    def __init__(
        self, registry: ResumeRegistry, stream: TokenStream, encode: Encode,
        observer: Observer | None,
    ) -> None:
        self.stream = stream
        self.request_id = stream.request_id
        self.holding = Holding.DETACHED
        self.last_n = 0  # the number of the last event logged
        self.log_bytes = 0
        self.is_ended = False  # the last event is logged
        self.published = False  # its failover spec is in the shared log: it can move
        self._registry = registry
        self._encode = encode
        self._observer = observer
        self._reader: Reader | None = None
        self._holder_scope: trio.CancelScope | None = None
        self._holder_done = trio.Event()
        self._taken_over = False

    def log_opening(self, data: bytes) -> None:
        self._append(data)

    def log_item(self, item: StreamItem) -> tuple[int, bytes]:
        """Number, encode and log an item just taken from the stream; return (n, bytes).

        Sync, never a checkpoint. Detached, an event that would pass the byte cap ends
        the stream instead (the returned event is then the ``resume_log_full`` error).
        """
        data = self._encode(self.last_n + 1, item)
        if self.holding is Holding.DETACHED and self._registry._would_overflow(len(data)):
            return self._overflow()
        ends = isinstance(item, FinishEvent | StreamError)
        self._append(data, last=ends)
        if self._observer is not None:
            self._observer.observe(item)
        if ends:
            self.is_ended = True
            self.stream.close()  # the engine is done with it: no cancel, just unregister
        return self.last_n, data

    def _overflow(self) -> tuple[int, bytes]:
        """End the stream for the byte cap: the engine is asked to cancel it, and a
        ``resume_log_full`` error is its last event (the one event past the cap)."""
        self._registry._overflows += 1
        error = StreamError(ErrorType.RESUME_LOG_FULL, "the server holds too many bytes "
                            "for streams without a reader")
        self.stream.close()
        data = self._encode(self.last_n + 1, error)
        self._append(data, last=True)
        if self._observer is not None:
            self._observer.observe(error)
        self.is_ended = True
        return self.last_n, data

    def _append(self, data: bytes, *, last: bool = False) -> None:
        self._registry._log.append(self.request_id, self.last_n + 1, data, last=last)
        self.last_n += 1
        self.log_bytes += len(data)
        self._registry._log_bytes += len(data)
        if self.holding is Holding.DETACHED:
            self._registry._detached_bytes += len(data)


class Reader:
    """The one reader of a resumable stream, positioned after event ``after``.

    Its owner (the response's connection) calls ``close()`` on every way out, which
    hands the stream back to the registry.
    """

    def __init__(self, entry: ResumableStream, after: int, token: str | None = None) -> None:
        self._entry = entry
        self._pos = after
        self._token = token  # its lease's token, with a shared log
        self._pending: deque[bytes] = deque()
        self._closed = False
        self._taken_over = False
        self._take: tuple[trio.CancelScope, trio.Event] | None = None  # a take in progress
        self._attached = trio.Event()  # set when its attach is done (the old one let go)
        self._renewed_at = trio.current_time()

    @property
    def request_id(self) -> str:
        return self._entry.request_id

    async def receive(self) -> LoggedEvent:
        """The next event: from the log while it has one after this reader's position,
        else the stream's next item, taken, logged and returned.

        Raises:
            trio.EndOfChannel: the stream ended and this reader has its last event.
            TakenOver: a newer reader took the stream over (here, or with a shared log
                on another replica: found at the lease's renewal).
            trio.ClosedResourceError: the reader was closed, or the stream cancelled.

        Cancellation: safe at every checkpoint, as ``TokenStream.receive``: an event
        leaves the log's pending list, or an item the stream, only when returned. A
        takeover cancels the take (only it) and the reader ends with ``TakenOver``.
        """
        await trio.lowlevel.checkpoint()
        await self._renew_lease()
        entry = self._entry
        if self._taken_over:
            raise TakenOver(TAKEN_OVER)
        if self._closed or entry.holding is Holding.GONE:
            raise trio.ClosedResourceError("the resumable stream is gone")
        if not self._pending and self._pos < entry.last_n:
            self._pending.extend(entry._registry._log.read_after(entry.request_id, self._pos) or ())
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
            # After a failover, an event this reader got from the dead owner before the
            # store had it: made again, the same bytes (the continuation is identical).
        raise trio.EndOfChannel

    async def _renew_lease(self) -> None:
        """With a shared log, every ``LEASE_CHECK_S``: renew this reader's lease, or find
        that a reader on another replica took it. Without an answer from the store, go
        on (as alone). Cancellation: nothing changed."""
        log = self._entry._registry._shared
        if log is None or self._token is None or self._taken_over:
            return
        if trio.current_time() - self._renewed_at < min(LEASE_CHECK_S, log.lease_s / 3):
            return
        try:
            held = await log.renew_reader(self._entry.request_id, self._token)
        except StoreUnavailable:
            held = True
        if not held:
            self._taken_over = True
        self._renewed_at = trio.current_time()

    async def _taken_over_by_another(self) -> bool:
        """Mark this reader taken over; wait, shielded and bounded, until its own attach
        is done and its take in progress (cancelled now) has exited. True once no take
        of it is left, False if the bound passed first."""
        self._taken_over = True
        with trio.CancelScope(shield=True, deadline=trio.current_time() + TAKEOVER_WAIT_S):
            await self._attached.wait()  # set already, but for a reader still attaching
            take = self._take
            if take is not None:
                take[0].cancel(reason=TAKEN_OVER)
                await take[1].wait()
        return self._attached.is_set() and self._take is None

    def close(self) -> None:
        """Let go of the stream: the registry holds it for the grace period (see the
        module docstring). Sync, idempotent, never a checkpoint."""
        if self._closed:
            return
        self._closed = True
        self._entry._registry._detach(self._entry, self)


class RemoteReader:
    """The one reader, on this replica, of a stream another replica owns: it follows the
    shared log from event ``after + 1`` until the stream's last event, holding the
    stream's reader lease (renewed before each read of the store, where it finds the
    lease taken over; released by ``close``).

    Made by ``ResumeRegistry.attach`` only; the same interface as ``Reader``.
    """

    def __init__(self, log: SharedEventLog, request_id: str, after: int, token: str,
                 on_close: Callable[[RemoteReader], None] | None = None) -> None:
        self._log = log
        self._on_close = on_close
        self._request_id = request_id
        self._pos = after
        self._token = token
        self._pending: deque[tuple[int, bytes, bool]] = deque()
        self._ended = False
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._request_id

    async def receive(self) -> LoggedEvent:
        """The next event from the shared log, waiting for the owner to append it.

        Raises:
            trio.EndOfChannel: this reader has the stream's last event.
            TakenOver: another reader took the lease over (found at a renewal).
            OwnerGone: the owner died; ``attach`` again to take the stream over.
            trio.ClosedResourceError: closed, the log is gone (expired or deleted: the
                owner ended the stream without a last event), or the store did not
                answer.

        Cancellation: safe at every checkpoint; an event leaves ``_pending`` only when
        returned, and a read cancelled in flight is read again.
        """
        await trio.lowlevel.checkpoint()
        log = self._log
        while not self._pending:
            if self._closed:
                raise trio.ClosedResourceError("the reader was closed")
            if self._ended:
                raise trio.EndOfChannel
            try:
                # Before every read of the store (one round trip a batch of events): a
                # reader taken over stops at once, not at a renewal seconds later.
                if not await log.renew_reader(self._request_id, self._token):
                    if await log.tail(self._request_id) is None:  # the owner forgot it
                        raise trio.ClosedResourceError("the stream's log is gone")
                    raise TakenOver(TAKEN_OVER)
                events = await log.read_remote(self._request_id, self._pos,
                                               wait_s=log.lease_s / 5)
                if not events and not await log.owner_alive(self._request_id):
                    # Its owner died: an attach (the body's, or the client's when it
                    # comes back) takes the stream over, here or on another replica.
                    raise OwnerGone("the stream's owner is gone", self._pos)
            except StoreUnavailable as exc:  # the client comes back, maybe elsewhere
                raise trio.ClosedResourceError(str(exc)) from exc
            if events is None:
                raise trio.ClosedResourceError("the stream's log is gone")
            self._pending.extend(e for e in events if e[0] > self._pos)
            if self._pending:
                self._ended = self._pending[-1][2]
        if self._closed:
            raise trio.ClosedResourceError("the reader was closed")
        n, data, _ = self._pending.popleft()
        self._pos = n
        return LoggedEvent(n, data, None)

    def close(self) -> None:
        """Let the lease go (queued); a ``receive`` in progress raises
        ``ClosedResourceError`` once its read of the store returns (within its wait).
        Sync, idempotent, never a checkpoint."""
        if not self._closed:
            self._closed = True
            self._log.release_reader(self._request_id, self._token)
            if self._on_close is not None:
                self._on_close(self)


class ResumeRegistry:
    """The resumable streams of one server and the nursery that holds detached ones.

    Args:
        log: where the events go (``MemoryEventLog`` by default in the app).
        grace_s: how long a stream without a reader is kept (and generates).
        max_detached_bytes: the cap on log bytes of streams without a reader.
        rebuild: with a shared log, how a stream whose owner died is continued here
            (failover); None: it is not (its readers follow the log until it expires).
    """

    def __init__(self, log: EventLog, *, grace_s: float, max_detached_bytes: int,
                 rebuild: Rebuild | None = None) -> None:
        # A detached stream must end some time: the grace period is finite.
        if not 0 <= grace_s < math.inf or max_detached_bytes < 0:
            raise ValueError("grace_s must be finite and >= 0, max_detached_bytes >= 0")
        self.grace_s = grace_s
        self.max_detached_bytes = max_detached_bytes
        self._log = log
        self._shared = log if isinstance(log, SharedEventLog) else None
        self._entries: dict[str, ResumableStream] = {}
        self._remote_readers: set[RemoteReader] = set()
        self._draining = False
        self._nursery: trio.Nursery | None = None
        self._log_bytes = self._detached_bytes = 0
        self._resumes = self._expiries = self._overflows = self._cancels = 0
        self._failovers = self._disowned = self._handed_over = 0
        self.rebuild = rebuild
        if self._shared is not None:
            self._shared.on_lost = self._lost

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the holders of detached streams. Never returns unless cancelled.

        Cancellation: every holder is cancelled; each closes its stream (the engine is
        asked to cancel) and expires its log. Streams attached then are closed by their
        readers' owners as usual.
        """
        if self._nursery is not None:
            raise RuntimeError("the registry runs once")
        try:
            async with trio.open_nursery() as nursery:
                if self._shared is not None:
                    await nursery.start(self._shared.run)
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            for entry in list(self._entries.values()):
                if entry.holding is Holding.DETACHED:
                    self._forget(entry)

    def drain(self) -> None:
        """This replica is going away: end its remote readers, refuse new ones (see the
        module docstring). Sync, idempotent, never a checkpoint."""
        self._draining = True
        for reader in list(self._remote_readers):
            reader.close()

    async def hand_over(self) -> int:
        """This replica drains and its deadline is near: leave each of its streams that
        has not ended to another replica (see the module docstring); how many. Returns
        once the store has every event they logged and their owner leases are let go.

        Sync up to that wait: each stream is closed (the engine is asked to cancel it:
        the one close path, blocks released once) and forgotten here only (the store's
        keys stay, for the replica that takes it over); its reader here, if any, ends
        without a final event. Without a shared log or without failover (``rebuild``),
        or for a stream without a published spec, nothing is handed over: the hub's
        drain ends them with ``shutdown`` as before.

        Raises:
            StoreUnavailable: the log stopped writing (the leases may stay until they
                lapse; a resume elsewhere then takes the streams over).

        Cancellation: only the wait for the store; the streams are handed over already.
        """
        log = self._shared
        if log is None or self.rebuild is None:
            await trio.lowlevel.checkpoint()
            return 0
        leaving = [e for e in self._entries.values()
                   if e.published and not e.is_ended and e.holding is not Holding.GONE]
        for entry in leaving:
            log.release_local_reader(entry.request_id)
            self._forget(entry, disowned=True)  # this replica's copy only
            log.release_owner(entry.request_id)  # queued after every event it logged
        self._handed_over += len(leaving)
        await log.stored()
        return len(leaving)

    async def stored(self) -> None:
        """With a shared log, return once everything logged so far is in the store (a
        stream just adopted: its spec, owner lease and first event, so that any replica
        finds it); without one, at once.

        Raises:
            StoreUnavailable: the log stopped writing.

        Cancellation: nothing changes (the log's writer goes on).
        """
        if self._shared is None:
            await trio.lowlevel.checkpoint()
            return
        await self._shared.stored()

    async def store_answers(self) -> bool:
        """Whether the shared log's store answers (True without one). Cancellation:
        the answer is not waited for."""
        if self._shared is None:
            await trio.lowlevel.checkpoint()
            return True
        try:
            await self._shared.ping()
        except StoreUnavailable:
            return False
        return True

    def adopt(
        self, stream: TokenStream, encode: Encode, opening: bytes, *,
        observer: Observer | None = None, attach: bool, spec: bytes | None = None,
    ) -> Reader | None:
        """Take a just-opened stream, log its opening (event 1), and either return its
        first reader (``attach``, positioned before event 1) or hold it detached for
        the grace period. Sync, never a checkpoint: the caller's ``open_stream`` hands
        the stream over before any. With a shared log, ``spec`` (what ``rebuild``
        needs) is published with the owner lease before event 1 (failover).

        Raises:
            RuntimeError: the registry is not running (the stream is closed first).
        """
        entry = ResumableStream(self, stream, encode, observer)
        if self._nursery is None:
            stream.close()
            raise RuntimeError("the resume registry is not running")
        self._entries[entry.request_id] = entry
        entry.holding = Holding.ATTACHED
        if self._shared is not None and spec is not None:
            self._shared.publish(entry.request_id, spec)
            entry.published = True
        entry.log_opening(opening)
        token = secrets.token_hex(8) if self._shared is not None and attach else None
        reader = Reader(entry, 0, token)
        reader._attached.set()
        entry._reader = reader
        if not attach:
            reader.close()
            return None
        if self._shared is not None and token is not None:
            self._shared.hold_local_reader(entry.request_id, token, claimed=False)
        return reader

    async def attach(self, request_id: str, after: int) -> Reader | RemoteReader:
        """The stream's reader from event ``after + 1`` on (0: from the start): a
        ``Reader`` if this replica owns the stream, else (with a shared log) a
        ``RemoteReader`` of the shared log.

        Raises:
            NothingToResume: unknown or expired, or ended with ``after`` its last event.
            BadPosition: ``after`` is past the last event made.
            ReaderBusy: the reader it takes over did not let go in time (see the
                module docstring).
            StoreUnavailable: the stream is not this replica's and the shared log's
                store did not answer.
            Draining: the stream is not this replica's, and this replica drains.

        Cancellation: the only checkpoint is the wait for the holder to exit, shielded:
        the holder has nothing left to do but exit, so it takes one scheduling round.
        With a shared log, also the claim of the lease (it is taken over from the
        old reader; a claim that lands after a cancel is released, or lapses).
        A reader attached now is taken over: see the module docstring.
        """
        entry = self._entries.get(request_id)
        log = self._shared
        if log is None:
            return await self._attach_local(request_id, after)
        if entry is None:
            return await self._attach_remote(log, request_id, after)
        self._check_position(entry, after)  # before the lease changes hands
        token = secrets.token_hex(8)
        try:
            await self._claim(log, request_id, token)
            reader = await self._attach_local(request_id, after, token)
        except BaseException:
            log.release_reader(request_id, token)
            raise
        log.hold_local_reader(request_id, token, claimed=True)
        return reader

    @staticmethod
    async def _claim(log: SharedEventLog, request_id: str, token: str) -> None:
        """Take the lease over for this replica's reader; without an answer from the
        store, go on (this replica goes on as it would alone)."""
        with contextlib.suppress(StoreUnavailable):
            await log.claim_reader(request_id, token)

    @staticmethod
    def _check_position(entry: ResumableStream, after: int) -> None:
        if after > entry.last_n:
            raise BadPosition(f"event {after} of a stream that has made {entry.last_n}")
        if entry.is_ended and after == entry.last_n:
            raise NothingToResume(entry.request_id)

    async def _attach_local(self, request_id: str, after: int, token: str | None = None) -> Reader:
        """``attach`` for a stream this replica owns."""
        entry = self._entries.get(request_id)
        if entry is None:
            await trio.lowlevel.checkpoint()
            raise NothingToResume(request_id)
        self._check_position(entry, after)
        reader = Reader(entry, after, token)
        old, entry._reader = entry._reader, reader  # a third attach meanwhile takes it over
        try:
            if old is not None:
                if not await old._taken_over_by_another():
                    if entry._reader is reader:
                        entry._reader = old  # it ends at its next receive; its close detaches
                    raise ReaderBusy(request_id)
            else:
                await self._take_from_holder(entry)
            if entry.holding is Holding.GONE:  # forgotten meanwhile (DELETE, or the holder)
                raise NothingToResume(request_id)
        finally:
            reader._attached.set()
        if entry._reader is not reader:  # a third attach took it over meanwhile
            reader._taken_over = True
        self._resumes += 1
        return reader

    async def _take_from_holder(self, entry: ResumableStream) -> None:
        """The detached stream back from its holder (ATTACHED again). Cancellation: the
        wait is shielded (the holder has no await left but its cancelled one)."""
        scope = entry._holder_scope
        if scope is not None:
            entry._taken_over = True
            scope.cancel(reason=TAKEN_OVER)
            with trio.CancelScope(shield=True):
                await entry._holder_done.wait()
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
        if entry.holding is Holding.GONE:  # the holder forgot it before it saw the cancel
            return
        entry.holding = Holding.ATTACHED
        self._detached_bytes -= entry.log_bytes
        entry._holder_scope, entry._holder_done, entry._taken_over = None, trio.Event(), False

    async def _attach_remote(
        self, log: SharedEventLog, request_id: str, after: int
    ) -> Reader | RemoteReader:
        """A reader of a stream another replica owns (see ``attach``), or, if that
        replica died and this one takes the stream over, its ``Reader`` here.

        A position past the store's last event is waited for (``POSITION_WAIT_S``): the
        owner writes an event to its reader before its writer task puts it in the
        store. With failover, also until the owner lease lapses (``owner_lease_s``
        more): a dead owner's last events may never have reached the store, and the
        takeover makes them again.
        """
        if self._draining:
            await trio.lowlevel.checkpoint()
            raise Draining(request_id)
        tail = await log.tail(request_id)
        if tail is None:
            raise NothingToResume(request_id)
        last_n, ended = tail
        rebuild, won = self.rebuild, False
        wait_s = POSITION_WAIT_S + (log.owner_lease_s if rebuild is not None else 0.0)
        with trio.move_on_after(wait_s):
            while True:
                if not ended and rebuild is not None:
                    won = await log.take_over(request_id)  # one round trip, atomic
                    if won:
                        break
                if after <= last_n or ended:
                    break
                events = await log.read_remote(request_id, last_n, wait_s=POSITION_STEP_S)
                if events is None:
                    raise NothingToResume(request_id)
                if events:
                    last_n, _, ended = events[-1]
        if won and rebuild is not None:  # out of the wait's scope: its timer cancels nothing
            return await self._fail_over(log, rebuild, request_id, after)
        if after > last_n:
            raise BadPosition(f"event {after} of a stream that has made {last_n}")
        if ended and after == last_n:
            raise NothingToResume(request_id)
        token = secrets.token_hex(8)
        await log.claim_reader(request_id, token)  # taken over from any reader holding it
        if self._draining:  # it began while the claim was in flight
            log.release_reader(request_id, token)
            raise Draining(request_id)
        self._resumes += 1
        reader = RemoteReader(log, request_id, after, token,
                              on_close=self._remote_readers.discard)
        self._remote_readers.add(reader)
        return reader

    async def _fail_over(
        self, log: SharedEventLog, rebuild: Rebuild, request_id: str, after: int
    ) -> Reader:
        """This replica won the owner lease of a stream whose owner died: rebuild it from
        the store and continue it here, appending to the same log; its reader from event
        ``after + 1`` (which may be past the store's last: the dead owner's writer lagged
        its reader; those events are made again, the same, and skipped).

        Cancellation: before the stream opens, the lease is let go (another resume may
        take over); once open, the registry holds it (a cancelled claim of the reader
        lease detaches it, as a reader that left).
        """
        adopted: list[Reader] = []

        def adopt(stream: TokenStream, encode: Encode, observer: Observer | None) -> None:
            entry = ResumableStream(self, stream, encode, observer)
            if self._nursery is None:
                stream.close()
                raise RuntimeError("the resume registry is not running")
            log.adopt(request_id, events)
            self._entries[request_id] = entry
            entry.holding = Holding.ATTACHED
            entry.published = True  # its spec is in the store: it may move on again
            entry.last_n = events[-1][0]
            entry.log_bytes = sum(len(data) for _, data, _ in events)
            self._log_bytes += entry.log_bytes
            reader = Reader(entry, after, secrets.token_hex(8))
            reader._attached.set()
            entry._reader = reader
            adopted.append(reader)

        try:
            got = await log.read_for_rebuild(request_id)
            if got is None:
                raise NothingToResume(request_id)
            spec, events = got
            await rebuild(request_id, spec, events, adopt)
        except BaseException:
            if not adopted:
                log.release_owner(request_id)
            raise
        (reader,) = adopted
        self._failovers += 1
        self._resumes += 1
        assert reader._token is not None
        try:
            await log.claim_reader(request_id, reader._token)
        except BaseException:
            reader.close()
            raise
        log.hold_local_reader(request_id, reader._token, claimed=True)
        return reader

    @staticmethod
    async def _remote_reader_holds(log: SharedEventLog, request_id: str) -> bool:
        """Whether a reader on another replica holds the stream; without an answer from
        the store, no (this replica goes on as it would alone)."""
        try:
            return await log.reader_held(request_id)
        except StoreUnavailable:
            return False

    def cancel(self, request_id: str) -> bool:
        """End a stream at once (the engine is asked to cancel it unless it finished)
        and forget it; False if unknown. Its reader, if any, sees it closed.
        Sync, never a checkpoint."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        self._cancels += 1
        self._forget(entry)
        return True

    def holding(self, request_id: str) -> Holding:
        """Who holds the stream now (GONE for one unknown or forgotten)."""
        entry = self._entries.get(request_id)
        return Holding.GONE if entry is None else entry.holding

    def statistics(self) -> ResumeStatistics:
        entries = self._entries.values()
        return ResumeStatistics(
            streams=len(self._entries),
            detached=sum(e.holding is Holding.DETACHED for e in entries),
            log_bytes=self._log_bytes,
            detached_bytes=self._detached_bytes,
            resumes=self._resumes,
            expiries=self._expiries,
            overflows=self._overflows,
            cancels=self._cancels,
            failovers=self._failovers,
            disowned=self._disowned,
            handed_over=self._handed_over,
        )

    # -- the hand-over (see the module docstring) ----------------------------------

    def _detach(self, entry: ResumableStream, reader: Reader) -> None:
        if entry._reader is not reader or entry.holding is Holding.GONE:
            return
        if self._shared is not None:
            self._shared.release_local_reader(entry.request_id)
        entry._reader = None
        entry.holding = Holding.DETACHED
        self._detached_bytes += entry.log_bytes
        if self._nursery is None:  # the registry stopped: nobody can hold it
            self._forget(entry)
            return
        if self._would_overflow(0):
            if entry.is_ended:
                self._forget(entry)
                return
            entry._overflow()
        scope = trio.CancelScope(deadline=trio.current_time() + self.grace_s)
        entry._holder_scope = scope
        self._nursery.start_soon(self._hold, entry, scope, entry._holder_done)

    async def _hold(
        self, entry: ResumableStream, scope: trio.CancelScope, done: trio.Event
    ) -> None:
        """Take and log the detached stream's items until its deadline, then end it.

        Cancellation: by a reader taking over, nothing is undone (the reader goes on
        from the log); by the deadline, ``cancel()`` or the registry stopping, the
        stream is closed (the engine asked to cancel) and its log expired. With a shared
        log, a deadline that passes while a reader on another replica holds the stream's
        lease starts another grace period instead.
        """
        try:
            while True:
                with scope:
                    while not entry.is_ended:
                        try:
                            item = await entry.stream.receive()
                        except (trio.EndOfChannel, trio.ClosedResourceError):
                            break
                        entry.log_item(item)  # Invariant: no checkpoint since the take
                    await trio.sleep_forever()  # keep the log for a reader until the deadline
                if (self._shared is None or entry._taken_over or entry.holding is Holding.GONE
                        or trio.current_time() < scope.deadline):
                    break
                # The grace period ran out; a reader on another replica may be following
                # the shared log: if one holds the lease, another grace period.
                held = await self._remote_reader_holds(self._shared, entry.request_id)
                if not held or entry._taken_over or entry.holding is Holding.GONE:
                    break
                scope = trio.CancelScope(deadline=trio.current_time() + self.grace_s)
                entry._holder_scope = scope
        finally:
            if not entry._taken_over and entry.holding is not Holding.GONE:
                if scope.cancelled_caught and trio.current_time() >= scope.deadline:
                    self._expiries += 1
                self._forget(entry)
            done.set()

    def _lost(self, request_id: str) -> None:
        """The shared log found that another replica took this replica's stream over
        (this one stalled past its owner lease): stop generating it, and forget it
        here without touching the store (its log is the new owner's now). Its reader
        here ends without a final event; its client resumes (and follows the new owner).
        Sync, never a checkpoint."""
        entry = self._entries.get(request_id)
        if entry is None or entry.is_ended:
            return
        self._disowned += 1
        self._forget(entry, disowned=True)

    def _forget(self, entry: ResumableStream, *, disowned: bool = False) -> None:
        """Close the stream (a cancel for the engine unless it finished), expire the log
        (``disowned``: only this replica's copy), drop the entry. Sync, idempotent,
        never a checkpoint."""
        if entry.holding is Holding.GONE:
            return
        if entry.holding is Holding.DETACHED:
            self._detached_bytes -= entry.log_bytes
        entry.holding = Holding.GONE
        if entry._holder_scope is not None:
            entry._holder_scope.cancel(reason="the resumable stream ended")
        self._entries.pop(entry.request_id, None)
        if disowned and self._shared is not None:
            self._log_bytes -= self._shared.disown(entry.request_id)
        else:
            self._log_bytes -= self._log.expire(entry.request_id)
        entry.stream.close()
        if entry._observer is not None:
            entry._observer.close()

    def _would_overflow(self, extra: int) -> bool:
        return self._detached_bytes + extra > self.max_detached_bytes

