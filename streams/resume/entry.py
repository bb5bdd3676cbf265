"""One resumable stream as the registry holds it: its TokenStream, its log, its holder.

The entry numbers, encodes and logs each item taken from its stream, with no checkpoint
between the take and the log (the caller's invariant; every method here is sync), so the
log has every event exactly once, in order. While detached it counts its bytes against
the server-wide cap (``byte_cap.py``) and ends its stream rather than pass it. It knows
nothing of who takes the items: a reader (``reader.py``) or the holder task
(``local.py``), whose scope and state it carries in ``holder``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import trio

from engine import FinishEvent

from ..stream import ErrorType, StreamError, StreamItem, TokenStream
from .byte_cap import ByteCap
from .errors import StoreFull
from .log import EventLog
from .records import Encode, Holding, Observer


@dataclass(eq=False, slots=True)
class Holder:
    """The task that holds a detached stream (``LocalStreams``): its cancel scope, whose
    deadline is the end of the grace period; set once it exited; whether a reader took
    the stream back from it (then it exits and undoes nothing)."""

    scope: trio.CancelScope
    done: trio.Event = field(default_factory=trio.Event)
    taken_over: bool = False


class ResumableStream:
    """One resumable stream: its TokenStream, log position and holder. Made by
    ``LocalStreams.add`` only (the one place entries are built).

    Args:
        logged: the events a failover found in the store (n, data, last): the log (the
            shared log's local copy) has them already; the next event follows them.
        published: its failover spec is in the shared log (it may move to a replica).
    """

    def __init__(
        self, stream: TokenStream, encode: Encode, observer: Observer | None,
        log: EventLog, cap: ByteCap, *, logged: Sequence[tuple[int, bytes, bool]] = (),
        published: bool = False,
    ) -> None:
        self.stream = stream
        self.request_id = stream.request_id
        self.holding = Holding.ATTACHED
        self.last_n = logged[-1][0] if logged else 0  # the number of the last event logged
        self.log_bytes = sum(len(data) for _, data, _ in logged)
        self.is_ended = False  # the last event is logged
        self.published = published
        self.holder: Holder | None = None  # while a holder task holds it
        # While it runs, held without a reader until then at least (trio time; a
        # background response's, ``ResumeRegistry.adopt(hold_s=...)``).
        self.run_until = -math.inf
        self._encode = encode
        self._observer = observer
        self._log = log
        self._cap = cap
        cap.logged(self.log_bytes, detached=False)

    def read_after(self, n: int) -> list[bytes] | None:
        """The logged events after ``n`` (None: the log no longer holds the stream)."""
        return self._log.read_after(self.request_id, n)

    def log_opening(self, data: bytes) -> None:
        """Log event 1. A shared store that takes none of the stream (its queue is full)
        has it logged here only, and the stream ended with an error event."""
        try:
            self._append(data)
        except StoreFull as exc:
            self._append(data)  # this replica's copy only, from now on
            self.fail(StreamError(ErrorType.UNAVAILABLE, str(exc)))

    def log_item(self, item: StreamItem) -> tuple[int, bytes]:
        """Number, encode and log an item just taken from the stream; return (n, bytes).

        Sync, never a checkpoint. Detached, an event that would pass the byte cap ends
        the stream instead (the returned event is then the ``resume_log_full`` error);
        so does one that a shared store's full queue refuses (``unavailable``).
        """
        data = self._encode(self.last_n + 1, item)
        if self.holding is Holding.DETACHED and self._cap.would_overflow(len(data)):
            return self.overflow()
        ends = isinstance(item, FinishEvent | StreamError)
        try:
            self._append(data, last=ends)
        except StoreFull as exc:
            return self.fail(StreamError(ErrorType.UNAVAILABLE, str(exc)))
        if self._observer is not None:
            self._observer.observe(item)
        if ends:
            self.is_ended = True
            self.stream.close()  # the engine is done with it: no cancel, just unregister
        return self.last_n, data

    def overflow(self) -> tuple[int, bytes]:
        """End the stream for the byte cap: the engine is asked to cancel it, and a
        ``resume_log_full`` error is its last event (the one event past the cap)."""
        self._cap.overflowed()
        return self.fail(StreamError(ErrorType.RESUME_LOG_FULL, "the server holds too many "
                                     "bytes for streams without a reader"))

    def fail(self, error: StreamError) -> tuple[int, bytes]:
        """End the stream with ``error`` as its last event (the engine is asked to cancel
        it); return (n, bytes) of that event. Sync, never a checkpoint."""
        self.stream.close()
        data = self._encode(self.last_n + 1, error)
        try:
            self._append(data, last=True)
        except StoreFull:  # the shared store takes no more of it: this replica's copy only
            self._append(data, last=True)
        if self._observer is not None:
            self._observer.observe(error)
        self.is_ended = True
        return self.last_n, data

    def detach(self) -> None:
        """No reader holds it any more: its bytes count against the cap."""
        self.holding = Holding.DETACHED
        self._cap.detached(self.log_bytes)

    def attach(self) -> None:
        """A reader took it back from its holder."""
        self.holding = Holding.ATTACHED
        self._cap.attached(self.log_bytes)
        self.holder = None

    def gone(self, freed: int) -> None:
        """Forgotten: its log expired (``freed`` bytes), its stream and observer closed.
        The caller cancels the holder first."""
        if self.holding is Holding.DETACHED:
            self._cap.attached(self.log_bytes)
        self.holding = Holding.GONE
        self._cap.freed(freed)

    def close(self) -> None:
        """Close the stream (a cancel for the engine unless it finished) and the
        observer. Sync, never a checkpoint."""
        self.stream.close()
        if self._observer is not None:
            self._observer.close()

    def _append(self, data: bytes, *, last: bool = False) -> None:
        self._log.append(self.request_id, self.last_n + 1, data, last=last)
        self.last_n += 1
        self.log_bytes += len(data)
        self._cap.logged(len(data), detached=self.holding is Holding.DETACHED)
