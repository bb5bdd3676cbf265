"""The streams this replica generates: detach, attach, and the holder task between.

Exactly one task takes a resumable stream's items, logs them and, while attached,
writes them. It changes hands in two places only, ``Reader.close`` (``detach``) and
``attach`` (take over)::

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

One reader at a time, the newest: ``attach`` while a reader holds the stream takes it
over (``Reader.give_way``), bounded by ``TAKEOVER_WAIT_S``; past it, ``ReaderBusy``.
With a shared log, a holder whose grace period runs out while a reader on another
replica holds the stream's reader lease starts another grace period instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from ..stream import TokenStream
from .byte_cap import ByteCap
from .entry import Holder, ResumableStream
from .errors import BadPosition, NothingToResume, ReaderBusy
from .log import EventLog, SharedEventLog, StoreUnavailable
from .reader import TAKEN_OVER, Reader
from .records import Encode, Holding, Observer


class LocalStreams:
    """The resumable streams this replica generates, and the holders of detached ones.

    Args:
        log: the event log (a ``SharedEventLog`` is also ``shared``).
        cap: the byte cap the entries count against.
        grace_s: how long a stream without a reader is kept (and generates).
    """

    def __init__(self, log: EventLog, shared: SharedEventLog | None, cap: ByteCap, *,
                 grace_s: float) -> None:
        self.grace_s = grace_s
        self._log = log
        self._shared = shared
        self._cap = cap
        self._entries: dict[str, ResumableStream] = {}
        self._readers: dict[str, Reader] = {}  # the reader that holds each stream, if any
        self._nursery: trio.Nursery | None = None
        self.resumes = self.expiries = self.disowned = 0

    def start(self, nursery: trio.Nursery) -> None:
        """Hold detached streams in ``nursery`` from now on."""
        self._nursery = nursery

    def stop(self) -> None:
        """The nursery is gone: forget every detached stream (its holder was cancelled)."""
        self._nursery = None
        for entry in list(self._entries.values()):
            if entry.holding is Holding.DETACHED:
                self.forget(entry)

    @property
    def running(self) -> bool:
        return self._nursery is not None

    def get(self, request_id: str) -> ResumableStream | None:
        return self._entries.get(request_id)

    def entries(self) -> list[ResumableStream]:
        return list(self._entries.values())

    def add(
        self, stream: TokenStream, encode: Encode, observer: Observer | None, *,
        token: str | None, after: int = 0, logged: Sequence[tuple[int, bytes, bool]] = (),
        published: bool,
    ) -> Reader:
        """Register a just-opened stream (ATTACHED) and return its first reader, from
        event ``after + 1``. The one place entries are built. Sync, never a checkpoint.

        Raises:
            RuntimeError: the registry is not running (the stream is closed first).
        """
        if self._nursery is None:
            stream.close()
            raise RuntimeError("the resume registry is not running")
        entry = ResumableStream(stream, encode, observer, self._log, self._cap,
                                logged=logged, published=published)
        self._entries[entry.request_id] = entry
        reader = self._reader(entry, after, token)
        reader.attached()
        self._readers[entry.request_id] = reader
        return reader

    @staticmethod
    def check_position(entry: ResumableStream, after: int) -> None:
        if after > entry.last_n:
            raise BadPosition(f"event {after} of a stream that has made {entry.last_n}")
        if entry.is_ended and after == entry.last_n:
            raise NothingToResume(entry.request_id)

    async def attach(self, request_id: str, after: int, token: str | None = None) -> Reader:
        """The stream's reader from event ``after + 1``, taken over from its reader or
        holder (see the module docstring; ``ResumeRegistry.attach`` says what it raises).

        Cancellation: once the stream is found, the attach is finished first: no
        checkpoint can raise, as the old reader's ``give_way`` (bounded) and the holder's
        exit (its last step) are waited for shielded, so an attach is never left
        half-done; the reader is returned and the caller's next checkpoint raises (its
        owner closes it: the stream is then handed over to a holder again). A stream not
        found: ``Cancelled`` or ``NothingToResume``, nothing to undo.
        """
        entry = self._entries.get(request_id)
        if entry is None:
            await trio.lowlevel.checkpoint()
            raise NothingToResume(request_id)
        self.check_position(entry, after)
        reader = self._reader(entry, after, token)
        old = self._readers.get(request_id)
        self._readers[request_id] = reader  # a third attach meanwhile takes it over
        try:
            if old is not None:
                if not await old.give_way():
                    if self._readers.get(request_id) is reader:
                        # The old one ends at its next receive; its close detaches.
                        self._readers[request_id] = old
                    raise ReaderBusy(request_id)
            else:
                await self._take_from_holder(entry)
            if entry.holding is Holding.GONE:  # forgotten meanwhile (DELETE, or the holder)
                raise NothingToResume(request_id)
        finally:
            reader.attached()
        if self._readers.get(request_id) is not reader:  # a third attach took it over
            reader.taken_over()
        self.resumes += 1
        return reader

    def cancel(self, request_id: str) -> bool:
        """Forget a stream at once (see ``ResumeRegistry.cancel``); False if unknown."""
        entry = self._entries.get(request_id)
        if entry is None:
            return False
        self.forget(entry)
        return True

    def lost(self, request_id: str) -> None:
        """The shared log found that another replica took this replica's stream over
        (this one stalled past its writer lease): stop generating it, and forget it
        here without touching the store (its log is the new writer's now). Its reader
        here ends without a final event; its client resumes (and follows the new
        writer). Sync, never a checkpoint."""
        entry = self._entries.get(request_id)
        if entry is None or entry.is_ended:
            return
        self.disowned += 1
        self.forget(entry, disowned=True)

    def forget(self, entry: ResumableStream, *, disowned: bool = False) -> None:
        """Close the stream (a cancel for the engine unless it finished), expire the log
        (``disowned``: only this replica's copy), drop the entry. Sync, idempotent,
        never a checkpoint."""
        if entry.holding is Holding.GONE:
            return
        if entry.holder is not None:
            entry.holder.scope.cancel(reason="the resumable stream ended")
        self._entries.pop(entry.request_id, None)
        self._readers.pop(entry.request_id, None)
        if disowned and self._shared is not None:
            freed = self._shared.disown(entry.request_id)
        else:
            freed = self._log.expire(entry.request_id)
        entry.gone(freed)
        entry.close()

    # -- detach, the holder, and back ----------------------------------------------

    def _reader(self, entry: ResumableStream, after: int, token: str | None) -> Reader:
        return Reader(entry, after, token, shared=self._shared, on_close=self._detach)

    def _detach(self, reader: Reader) -> None:
        entry = reader.entry
        if self._readers.get(entry.request_id) is not reader or entry.holding is Holding.GONE:
            return
        if self._shared is not None:
            self._shared.release_local_reader(entry.request_id)
        del self._readers[entry.request_id]
        entry.detach()
        if self._nursery is None:  # the registry stopped: nobody can hold it
            self.forget(entry)
            return
        if self._cap.would_overflow():
            if entry.is_ended:
                self.forget(entry)
                return
            entry.overflow()
        deadline = trio.current_time() + self.grace_s
        if not entry.is_ended:
            deadline = max(deadline, entry.run_until)
        holder = Holder(trio.CancelScope(deadline=deadline))
        entry.holder = holder
        self._nursery.start_soon(self._hold, entry, holder)

    async def _take_from_holder(self, entry: ResumableStream) -> None:
        """The detached stream back from its holder (ATTACHED again). Cancellation: finished
        first: the wait is shielded, and short (the holder has no await left but its
        cancelled one)."""
        holder = entry.holder
        if holder is not None:
            holder.taken_over = True
            holder.scope.cancel(reason=TAKEN_OVER)
            with trio.CancelScope(shield=True):
                await holder.done.wait()
        else:
            await trio.lowlevel.cancel_shielded_checkpoint()
        if entry.holding is Holding.GONE:  # the holder forgot it before it saw the cancel
            return
        entry.attach()

    async def _hold(self, entry: ResumableStream, holder: Holder) -> None:
        """Take and log the detached stream's items until its deadline, then end it.

        Cancellation: by a reader taking over, nothing to undo (the reader goes on from
        the log); by the deadline, ``cancel()`` or the registry stopping, the stream is
        closed by its owner, the registry (the engine asked to cancel; the blocks back at
        the next step boundary), and its log expired. With a shared
        log, a deadline that passes while a reader on another replica holds the stream's
        lease starts another grace period instead.
        """
        scope = holder.scope
        try:
            while True:
                with scope:
                    while not entry.is_ended:
                        try:
                            item = await entry.stream.receive()
                        except (trio.EndOfChannel, trio.ClosedResourceError):
                            break
                        entry.log_item(item)  # Invariant: no checkpoint since the take
                    # Ended: its log is kept a grace period at most (a deadline past that
                    # held a running stream, ``run_until``).
                    scope.deadline = min(scope.deadline, trio.current_time() + self.grace_s)
                    await trio.sleep_forever()  # keep the log for a reader until the deadline
                if (self._shared is None or holder.taken_over or entry.holding is Holding.GONE
                        or trio.current_time() < scope.deadline):
                    break
                # The grace period ran out; a reader on another replica may be following
                # the shared log: if one holds the lease, another grace period.
                held = await self._reader_elsewhere(self._shared, entry.request_id)
                if not held or holder.taken_over or entry.holding is Holding.GONE:
                    break
                scope = trio.CancelScope(deadline=trio.current_time() + self.grace_s)
                holder.scope = scope
        finally:
            if not holder.taken_over and entry.holding is not Holding.GONE:
                if scope.cancelled_caught and trio.current_time() >= scope.deadline:
                    self.expiries += 1
                self.forget(entry)
            holder.done.set()

    @staticmethod
    async def _reader_elsewhere(log: SharedEventLog, request_id: str) -> bool:
        """Whether a reader on another replica holds the stream; without an answer from
        the store, no (this replica goes on as it would alone).

        Cancellation: the read is abandoned (nothing changes); the holder's ``finally``
        then forgets the stream, as at a deadline with no reader elsewhere.
        """
        try:
            return await log.reader_held(request_id)
        except StoreUnavailable:
            return False
