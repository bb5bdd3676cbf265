"""Resumable streams: a stream whose reader left is held, and the next reader takes it.

The registry keeps, for each resumable stream, its ``TokenStream`` and a log of its
encoded events (``log.EventLog``), so a reader that comes back with the number of the
last event it got replays the rest and then follows live. It knows nothing of HTTP: the
app gives it an encoder (``(n, item) -> bytes``) and serves its readers. It is the
owner of its streams (it closes them); the jobs live apart:

- ``entry.py``: one stream, its numbering and logging; ``byte_cap.py``: the cap on the
  bytes of detached streams;
- ``local.py``: detach and attach on this replica, and the holder task between
  (``reader.py``: the reader here);
- ``replicas.py``: readers through a shared log (``remote_reader.py``), with
  ``failover.py`` (a dead writer's stream continued here); a draining replica's
  streams are left to another by ``hand_over``;
- ``log.py``, ``redis_log.py``: the logs; ``spec.py``: what a rebuild needs.

Numbering: event 1 is the opening (the app's ``start``); each item taken is the next
number, assigned and logged with no checkpoint between taking and logging, so the log
has every event exactly once, in order.

Memory: a stream's log holds at most its own events (the opening, at most
``max_new_tokens`` tokens, one last event). The bytes of detached streams (running or
finished) are capped server-wide (``max_detached_bytes``): a detached stream whose next
event would pass the cap is ended instead, with a StreamError ``resume_log_full`` as its
last event (the one event allowed past the cap) and the engine asked to cancel it; a
finished log that would pass the cap when its reader leaves is expired at once (later
readers get nothing). Only the first is counted, in ``overflows``. A log is kept after
the stream ended until the grace period after its last reader left, for a reader whose
connection broke before the last event reached it.

Cancellation: a client's cancel never reaches a held stream: it was handed over to the
registry, whose holders run in the registry's nursery (``run``). Cancelling ``run``
cancels them, and each stream is closed by its owner, the holder, on the way out (the
engine is asked to cancel) and its log expired.

Failover. The writer (the replica whose engine generates a stream) publishes, with a new
stream's first event, what a rebuild needs (``adopt(spec=...)``: the app's request,
prompt token ids and seed) and holds a writer lease that its log renews until the
stream's last event. A remote reader whose read comes back empty while the writer lease
is gone raises ``WriterGone`` with its position; the app attaches again there, in the
same response, which takes the stream over (``failover.py``).
"""

from __future__ import annotations

import math
import secrets

import trio

from ..stream import TokenStream
from .byte_cap import ByteCap
from .local import LocalStreams
from .log import EventLog, SharedEventLog, StoreUnavailable
from .reader import Reader
from .records import Encode, Holding, Observer, Rebuild, ResumeStatistics
from .remote_reader import RemoteReader
from .replicas import Replicas


class ResumeRegistry:
    """The resumable streams of one server and the nursery that holds detached ones.

    Args:
        log: where the events go (``MemoryEventLog`` by default in the app).
        grace_s: how long a stream without a reader is kept (and generates).
        max_detached_bytes: the cap on log bytes of streams without a reader.
        rebuild: with a shared log, how a stream whose writer died is continued here
            (failover); None: it is not (its readers follow the log until it expires).
    """

    def __init__(self, log: EventLog, *, grace_s: float, max_detached_bytes: int,
                 rebuild: Rebuild | None = None) -> None:
        # A detached stream must end some time: the grace period is finite.
        if not 0 <= grace_s < math.inf or max_detached_bytes < 0:
            raise ValueError("grace_s must be finite and >= 0, max_detached_bytes >= 0")
        self.grace_s = grace_s
        self.max_detached_bytes = max_detached_bytes
        self.rebuild = rebuild
        self._shared = log if isinstance(log, SharedEventLog) else None
        self._cap = ByteCap(max_detached_bytes)
        self._local = LocalStreams(log, self._shared, self._cap, grace_s=grace_s)
        self._replicas = None if self._shared is None else Replicas(self._shared, self._local)
        self._cancels = self._handed_over = 0
        self._remote_cancels = 0
        if self._shared is not None:
            self._shared.on_lost = self._local.lost
            self._shared.on_cancelled = self._cancelled_elsewhere

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the holders of detached streams. Never returns unless cancelled.

        Cancellation: every holder is cancelled; each stream held is closed by its owner,
        the holder (the engine is asked to cancel), and its log expired. Streams attached
        then are closed by their readers' owners as usual.
        """
        if self._local.running:
            raise RuntimeError("the registry runs once")
        try:
            async with trio.open_nursery() as nursery:
                if self._shared is not None:
                    await nursery.start(self._shared.run)
                self._local.start(nursery)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._local.stop()

    def drain(self) -> None:
        """This replica is going away: end its remote readers, refuse new ones
        (``replicas.py``). Sync, idempotent, never a checkpoint."""
        if self._replicas is not None:
            self._replicas.drain()

    async def hand_over(self) -> int:
        """This replica drains and its deadline is near: leave each of its published
        streams that has not ended to another replica; how many. Returns once the store
        has every event they logged and their writer leases are let go (compare-and-
        delete, in the same ordered batches as the events), so a resume on another
        replica takes each over at once and continues it with the same tokens.

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
        leaving = [e for e in self._local.entries()
                   if e.published and not e.is_ended and e.holding is not Holding.GONE]
        for entry in leaving:
            log.release_local_reader(entry.request_id)
            self._local.forget(entry, disowned=True)  # this replica's copy only
            log.release_writer(entry.request_id)  # queued after every event it logged
        handed = len(leaving)
        self._handed_over += handed
        await log.stored()
        return handed

    async def stored(self) -> None:
        """With a shared log, return once everything logged so far is in the store (a
        stream just adopted: its spec, writer lease and first event, so that any replica
        finds it); without one, at once.

        Raises:
            StoreUnavailable: the log stopped writing.

        Cancellation: nothing to undo: it only waits; the log's writer goes on, and a
        stream adopted already stays the registry's (handed over).
        """
        if self._shared is None:
            await trio.lowlevel.checkpoint()
            return
        await self._shared.stored()

    async def store_answers(self) -> bool:
        """Whether the shared log's store answers (True without one). Cancellation:
        abandoned: a ping changes nothing, so the answer is not waited for."""
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
        attach_within_s: float | None = None, hold_s: float | None = None,
    ) -> Reader | None:
        """Take a just-opened stream, log its opening (event 1), and either return its
        first reader (``attach``, positioned before event 1) or hold it detached for
        the grace period. Sync, never a checkpoint: the caller's ``open_stream`` hands
        the stream over before any. With a shared log, ``spec`` (what ``rebuild``
        needs) is published with the writer lease before event 1 (failover).
        ``attach_within_s`` (with ``attach=False``): the first grace period is that
        long, if shorter: a stream nobody ever came to read ends sooner. ``hold_s``:
        while it runs, it is held without a reader for that long from now at least,
        if longer than the grace period (a background response, which nobody need
        read); once it ended, its log is kept for the grace period as any other's.

        Raises:
            RuntimeError: the registry is not running (the stream is closed first).
        """
        shared = self._shared
        token = secrets.token_hex(8) if shared is not None and attach else None
        publish = shared is not None and spec is not None
        reader = self._local.add(stream, encode, observer, token=token, published=publish)
        if hold_s is not None:
            reader.entry.run_until = trio.current_time() + hold_s
        if shared is not None and spec is not None:
            shared.publish(reader.request_id, spec)
        reader.entry.log_opening(opening)
        if not attach:
            reader.close()
            holder = reader.entry.holder
            if holder is not None and attach_within_s is not None:
                holder.scope.deadline = min(holder.scope.deadline,
                                            trio.current_time() + attach_within_s)
            return None
        if shared is not None and token is not None:
            shared.hold_local_reader(reader.request_id, token, claimed=False)
        return reader

    async def attach(self, request_id: str, after: int) -> Reader | RemoteReader:
        """The stream's reader from event ``after + 1`` on (0: from the start): a
        ``Reader`` if this replica generates the stream, else (with a shared log) a
        ``RemoteReader`` of the shared log.

        Raises:
            NothingToResume: unknown or expired, or ended with ``after`` its last event.
            BadPosition: ``after`` is past the last event made.
            ReaderBusy: the reader it takes over did not let go in time (``local.py``).
            StoreUnavailable: the stream is not this replica's and the shared log's
                store did not answer.
            Draining: the stream is not this replica's, and this replica drains.

        Cancellation: the hand-over is finished first: the only checkpoint is the wait
        for the holder to exit, shielded: the holder has nothing left to do but exit, so
        it takes one scheduling round. With a shared log, also the claim of the lease,
        abandoned (it is taken over from the old reader; a claim that lands after a
        cancel is released, or lapses).
        A reader attached now is taken over (``local.py``).
        """
        if self._replicas is None:
            return await self._local.attach(request_id, after)
        return await self._replicas.attach(request_id, after, self.rebuild)

    def cancel(self, request_id: str) -> bool:
        """End a stream at once (the engine is asked to cancel it unless it finished)
        and forget it; False if unknown. Its reader, if any, sees it closed.
        Sync, never a checkpoint."""
        if not self._local.cancel(request_id):
            return False
        self._cancels += 1
        return True

    async def logged(self, request_id: str) -> list[bytes] | None:
        """Every event of the stream logged so far (event 1 first), without attaching a
        reader: this replica's log, else (with a shared log) the store's; None if
        neither holds it (the Responses API's ``GET /v1/responses/<id>`` re-reads a
        background response's events so).

        Raises:
            StoreUnavailable, StoreRejected: (a shared log) the store's read failed.

        Cancellation: nothing to undo: a read (a shared log's is abandoned to its thread).
        """
        entry = self._local.get(request_id)
        if entry is not None or self._shared is None:
            await trio.lowlevel.checkpoint()
            return None if entry is None else entry.read_after(0)
        found = await self._shared.read_for_rebuild(request_id)
        return None if found is None else [data for _, data, _ in found[1]]

    def generating_detached(self) -> int:
        """Streams held with no reader that have not ended (they generate for nobody)."""
        return sum(e.holding is Holding.DETACHED and not e.is_ended
                   for e in self._local.entries())

    async def cancel_anywhere(self, request_id: str) -> bool:
        """``cancel``, and with a shared log, for a stream another replica generates, a
        cancel through the store: that replica ends it at its next renewal of the
        stream's writer lease (the log's ``refresh_s``), or its keys go at once if it
        died. False if neither knows it.

        Raises:
            StoreUnavailable: not this replica's stream, and the store did not answer.

        Cancellation: abandoned at the ask of the store: the cancel is one atomic script
        in Redis, so it lands whole or not, unknown to the caller; asked again, it is
        idempotent. A local stream is closed before any checkpoint.
        """
        if self.cancel(request_id):
            await trio.lowlevel.checkpoint()
            return True
        if self._shared is None:
            await trio.lowlevel.checkpoint()
            return False
        if not await self._shared.cancel_remote(request_id):
            return False
        self._remote_cancels += 1
        return True

    def _cancelled_elsewhere(self, request_id: str) -> None:
        """The shared log found a cancel mark that a DELETE on another replica left."""
        self.cancel(request_id)

    def holding(self, request_id: str) -> Holding:
        """Who holds the stream now (GONE for one unknown or forgotten)."""
        entry = self._local.get(request_id)
        return Holding.GONE if entry is None else entry.holding

    def statistics(self) -> ResumeStatistics:
        entries, local, replicas = self._local.entries(), self._local, self._replicas
        store = None if self._shared is None else self._shared.statistics()
        return ResumeStatistics(
            streams=len(entries),
            detached=sum(e.holding is Holding.DETACHED for e in entries),
            log_bytes=self._cap.log_bytes,
            detached_bytes=self._cap.detached_bytes,
            resumes=local.resumes + (0 if replicas is None else replicas.resumes),
            expiries=local.expiries,
            overflows=self._cap.overflows,
            cancels=self._cancels,
            failovers=0 if replicas is None else replicas.failovers,
            disowned=local.disowned,
            handed_over=self._handed_over,
            store_pending=0 if store is None else store.pending,
            store_batches=0 if store is None else store.batches,
            store_commands=0 if store is None else store.commands,
            store_failed_batches=0 if store is None else store.failed_batches,
            spec_rejected=0 if replicas is None else replicas.spec_rejected,
            events_rejected=0 if replicas is None else replicas.events_rejected,
            remote_cancels=self._remote_cancels,
            store_refused=0 if store is None else store.refused,
            store_dropped=0 if store is None else store.dropped,
            store_cut_streams=0 if store is None else store.cut_streams,
            store_read_errors=0 if store is None else store.read_errors,
        )
