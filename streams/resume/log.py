"""The event log of resumable streams: what a reader that comes back replays.

Owns the encoded events of each resumable stream, numbered from 1 in the order they
were made, and nothing else: it knows no engine and no HTTP (``MemoryEventLog`` no
Trio either). ``EventLog`` is the interface the resume registry (``registry.py``)
uses; ``MemoryEventLog``, a dict of lists in this process, is the default. A shared
store (``redis_log.RedisEventLog``: Redis streams, for several replicas serving one
client population, issue 11) implements the same three operations for the replica that
writes a stream (its engine generates it), and ``SharedEventLog``'s async ones for a
reader on any replica.

Synchronous on purpose: a live event is taken from its stream and logged with no
checkpoint between (``entry.py``), so no cancel can lose one. A networked store
keeps that property by appending to a local copy and a queue that a task of its own
writes out in order (``redis_writer.py``); the writer's ``read_after`` reads the local copy.

Bounds: the log does not limit itself. The registry gives each stream at most its own
events (a start, at most ``max_new_tokens`` tokens, one last event) and caps the bytes
of the streams no reader holds (``resume_max_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import trio


class EventLog(Protocol):
    """Encoded events per stream id, numbered 1, 2, ...; every method sync, no checkpoint."""

    def append(self, stream_id: str, n: int, data: bytes, *, last: bool = False) -> None:
        """Store event ``n`` of ``stream_id`` (a new stream starts at 1); ``last``: the
        stream's last event (a reader on another replica stops after it).

        Raises:
            ValueError: ``n`` is not the stream's next number (the log never has a gap
                or a duplicate).
            StoreFull: (a shared log) its store takes no more of this stream; nothing
                was logged, and the next append goes to this replica's copy only.
        """
        ...

    def read_after(self, stream_id: str, n: int) -> list[bytes] | None:
        """Events ``n+1``, ``n+2``, ... of ``stream_id`` in order; None for a stream the
        log does not hold (never appended to, or expired)."""
        ...

    def expire(self, stream_id: str) -> int:
        """Forget ``stream_id``'s events; return the bytes freed (0 if none). Idempotent."""
        ...


class StoreUnavailable(Exception):
    """A shared log's store did not answer (its async methods raise it)."""


@dataclass(frozen=True, slots=True)
class StoreStatistics:
    """A shared log's writes to its store; counters count since construction."""

    pending: int  # commands queued, not yet written
    batches: int  # batches written
    commands: int  # commands written
    failed_batches: int  # batches that failed to reach the store (then tried again)
    refused: int = 0  # commands the store refused (logged; a retry's duplicates aside)
    dropped: int = 0  # commands not queued: the queue was full (leases, refreshes, deletes)
    cut_streams: int = 0  # streams cut from the store for the full queue (ended with error)
    read_errors: int = 0  # reads and renewals the store did not answer


@runtime_checkable
class SharedEventLog(EventLog, Protocol):
    """An ``EventLog`` that other replicas read: what a reader there needs, async.

    The writer replica (the one whose engine generates the stream) appends; a reader on
    any replica follows the log (``read_remote``) until the event appended ``last``.
    One reader at a time across replicas, the newest: every reader, on the writer or
    elsewhere, holds the stream's lease (a token with a time to live, renewed while it
    reads); a new reader takes it over, and the old one learns it when it renews. The
    writer also checks it before it ends a stream whose grace period ran out.

    The async methods raise ``StoreUnavailable`` when the store does not answer, and
    those that return a stream's events or spec ``StoreRejected`` for one that fails its
    check (signed by the replicas, ``signing.py``); the sync ones never wait for it (the
    writer tries a batch again until it is written; past its bound, ``append`` raises
    ``StoreFull`` once for the stream it cuts from the store).
    """

    lease_s: float  # a remote reader's lease lives this long unless renewed
    writer_lease_s: float  # the writer's lease on a stream it generates (failover)

    def statistics(self) -> StoreStatistics:
        """What the log wrote to its store so far (for /stats)."""
        ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write what ``append``/``expire`` queued, in order, until cancelled.

        Cancellation: the way it stops. A write in flight is abandoned (one transaction:
        it lands whole or not); nothing is written after it (none may overtake it), so
        what is left expires by its time to live, and the leases it renewed lapse
        (other replicas may take over).
        """
        ...

    async def tail(self, stream_id: str) -> tuple[int, bool] | None:
        """(n of the last event in the store, whether it is the last), or None.

        Cancellation: nothing to undo: a read changes nothing, so an implementation may
        abandon it to its thread.
        """
        ...

    async def ping(self) -> None:
        """Return once the store answered (``StoreUnavailable`` if it does not).
        Cancellation: nothing to undo: a ping changes nothing (it may be abandoned)."""
        ...

    async def stored(self) -> None:
        """Return once everything queued before the call is in the store
        (``StoreUnavailable`` if the log stopped writing). Writes nothing itself.
        Cancellation: nothing to undo: it only waits; the writer goes on."""
        ...

    async def read_remote(
        self, stream_id: str, after: int, *, wait_s: float
    ) -> list[tuple[int, bytes, bool]] | None:
        """Events after ``after`` as (n, data, last), waiting up to ``wait_s`` for one
        (empty: none came); None: the store no longer holds the stream.

        Cancellation: nothing to undo: a read changes nothing (it may be abandoned), and
        the events it did not return are read again by the next call from the same
        position, so none is lost.
        """
        ...

    async def claim_reader(self, stream_id: str, token: str) -> None:
        """Take the stream's reader lease for ``token``, from whoever holds it.

        Cancellation: abandoned: the claim may still land, unknown to the caller, who lets
        ``token`` go (``release_reader``) on its way out; else it lapses in ``lease_s``.
        """
        ...

    async def renew_reader(self, stream_id: str, token: str) -> bool:
        """Extend ``token``'s lease; False if it is not ``token``'s any more (taken over,
        or lapsed). A new stream's lease whose SET is still queued counts as held.

        Cancellation: abandoned: the lease may be renewed once more; it lapses within
        ``lease_s`` unless its reader lets it go first.
        """
        ...

    def release_reader(self, stream_id: str, token: str) -> None:
        """Let the lease go (queued, sync, never a checkpoint)."""
        ...

    def hold_local_reader(self, stream_id: str, token: str, *, claimed: bool) -> None:
        """A reader on this replica (the writer) holds the lease as ``token`` (``claimed``:
        by ``claim_reader``; else it is set, queued: a stream just opened); the log
        renews it until ``release_local_reader`` or ``expire``. Sync, no checkpoint."""
        ...

    def release_local_reader(self, stream_id: str) -> None:
        """Let this replica's reader's lease go (queued). Sync, never a checkpoint."""
        ...

    async def reader_held(self, stream_id: str) -> bool:
        """Whether a reader (on any replica) holds the stream's lease now.
        Cancellation: nothing to undo: a read (it may be abandoned)."""
        ...

    # Failover: the writer holds a lease on each stream it generates (renewed by ``run``
    # until the stream's last event); once it lapses, another replica may take over.

    def publish(self, stream_id: str, spec: bytes) -> None:
        """A new stream this replica generates: store ``spec`` (what a rebuild needs)
        and take its writer lease, both before its first event. Sync, no checkpoint."""
        ...

    async def writer_alive(self, stream_id: str) -> bool:
        """Whether the stream's writer lease is held (by any replica).
        Cancellation: nothing to undo: a read (it may be abandoned)."""
        ...

    async def take_over(self, stream_id: str) -> bool:
        """Atomically take the writer lease of a stream whose writer's lapsed, unless its
        last event ended it or it has no spec: True for exactly one caller.

        Cancellation: finished first, never losing a grant: the call returns the store's
        answer even if cancelled meanwhile (it waits for it), and the caller owns a lease
        it won: it lets it go (``release_writer``) if it does not continue the stream. (A
        lease granted and lost would be held by nobody who writes or renews it: the
        stream would stall until it lapsed; issue 34, D1.)
        """
        ...

    async def read_for_rebuild(
        self, stream_id: str
    ) -> tuple[bytes, list[tuple[int, bytes, bool]]] | None:
        """(spec, every event as (n, data, last)) of a stream, or None if gone.
        Cancellation: nothing to undo: a read (it may be abandoned)."""
        ...

    def adopt(self, stream_id: str, events: list[tuple[int, bytes, bool]]) -> None:
        """This replica generates the stream from now on: its local copy starts with
        ``events`` (already in the store); the next ``append`` is the one after."""
        ...

    def release_writer(self, stream_id: str) -> None:
        """Let this replica's writer lease go if it is still this replica's (queued,
        after everything queued before; a rebuild that failed, a drain's hand-over)."""
        ...

    on_lost: Callable[[str], None] | None  # told of a stream another replica took over

    def disown(self, stream_id: str) -> int:
        """Forget a stream another replica took over, locally only (its keys in the store
        are the new writer's); the bytes freed. Sync, no checkpoint."""
        ...

    # A DELETE on a replica that does not generate the stream: a mark in the store, which
    # the writer finds at its next renewal and tells ``on_cancelled`` of.

    async def cancel_remote(self, stream_id: str) -> bool:
        """Cancel a stream another replica generates (its keys deleted at once if its
        writer died); False if the store does not hold it.

        Cancellation: abandoned: the cancel may still land (one atomic step in the
        store), unknown to the caller; a cancel tried again is idempotent.
        """
        ...

    on_cancelled: Callable[[str], None] | None  # told of a stream cancelled elsewhere


class MemoryEventLog:
    """``EventLog`` in this process's memory: one list of bytes per stream."""

    def __init__(self) -> None:
        self._events: dict[str, list[bytes]] = {}
        self._bytes: dict[str, int] = {}

    def append(self, stream_id: str, n: int, data: bytes, *, last: bool = False) -> None:
        events = self._events.setdefault(stream_id, [])
        if n != len(events) + 1:
            raise ValueError(f"event {n} of {stream_id!r} follows {len(events)}")
        events.append(data)
        self._bytes[stream_id] = self._bytes.get(stream_id, 0) + len(data)

    def read_after(self, stream_id: str, n: int) -> list[bytes] | None:
        events = self._events.get(stream_id)
        return None if events is None else events[max(n, 0):]

    def expire(self, stream_id: str) -> int:
        self._events.pop(stream_id, None)
        return self._bytes.pop(stream_id, 0)

    @property
    def total_bytes(self) -> int:
        """Bytes held for every stream."""
        return sum(self._bytes.values())
