"""The resume registry's plain data: who holds a stream, one event read, the statistics,
and what the app hands the registry (an encoder, an observer, its rebuild)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..stream import StreamItem, TokenStream

Encode = Callable[[int, StreamItem], bytes]


class Holding(enum.Enum):
    """Who takes a resumable stream's items now (see ``registry.py``'s docstring)."""

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
    failovers: int = 0  # streams of a dead writer taken over and continued here
    disowned: int = 0  # streams of this replica another one took over (it had stalled)
    handed_over: int = 0  # streams left to another replica at a drain (hand_over)
    # Failovers refused: the store's spec or events failed their HMAC, or the spec failed
    # this replica's limits (each reader got an error event instead).
    spec_rejected: int = 0
    events_rejected: int = 0  # remote reads ended: an event in the store failed its HMAC
    remote_cancels: int = 0  # DELETEs here of streams another replica generates
    # With a shared log (0 without): its writes to the store (``StoreStatistics``).
    store_pending: int = 0  # commands queued, not yet written
    store_batches: int = 0  # batches written
    store_commands: int = 0  # commands written
    store_failed_batches: int = 0  # batches that failed to reach the store (tried again)
    store_refused: int = 0  # commands the store refused
    store_dropped: int = 0  # commands not queued: the queue was full
    store_cut_streams: int = 0  # streams cut from the store, the queue full (error event)
    store_read_errors: int = 0  # reads and renewals the store did not answer


class Observer(Protocol):
    """Told of every item logged (the app's metrics timer); closed when forgotten."""

    def observe(self, item: StreamItem) -> None: ...
    def close(self) -> None: ...


# What a rebuild hands its new stream to, in the same call that opens it (no checkpoint).
Adopt = Callable[[TokenStream, Encode, "Observer | None"], None]


class Rebuild(Protocol):
    """The app's side of a failover: open the stream again from its ``spec`` (what
    ``adopt(spec=...)`` published; its HMAC checked) and its ``events`` so far (n, data,
    last), continuing after them, and hand it to ``adopt`` as it opens. Raises
    ``StoreRejected`` for a spec it refuses (its limits), else what opening raises.
    ``refusal``: the event (without an id) that ends a reader's body instead when what
    the store holds for the stream is refused."""

    async def __call__(self, request_id: str, spec: bytes,
                       events: list[tuple[int, bytes, bool]], adopt: Adopt) -> None:
        """Open the stream again and hand it to ``adopt`` as it opens.

        Cancellation: before ``adopt``, nothing to undo: nothing may be left open (the
        caller then lets the writer lease go); after, handed over: an implementation
        calls ``adopt`` with no checkpoint after the stream opens, so a cancel never
        leaves an open stream without an owner.
        """
        ...

    def refusal(self, request_id: str, message: str) -> bytes: ...
