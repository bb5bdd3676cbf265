"""Why a reader cannot attach to a resumable stream, or stops reading it."""

from __future__ import annotations

import trio


class ResumeError(Exception):
    """A reader cannot attach; the subclass says why."""


class NothingToResume(ResumeError):
    """The stream is unknown or expired, or it ended and the reader has every event."""


class ReaderBusy(ResumeError):
    """The old reader did not let go within ``TAKEOVER_WAIT_S`` (try again)."""


class BadPosition(ResumeError):
    """The reader claims an event the stream has not made yet."""


class Draining(ResumeError):
    """This replica is draining: it follows no other replica's stream (resume elsewhere)."""


class StoreRejected(ResumeError):
    """What the shared store holds for a stream is refused, never served or run: a spec or
    an event that fails its HMAC (``signing.py``: altered, or written without this
    replica's resume secret), or a spec this replica's limits refuse (the app's rebuild)."""


class StoreFull(Exception):
    """The shared log's queue of commands for its store is full (the store does not keep
    up, or does not answer): the stream appended to is not written to the store any more.
    Nothing was logged; its next ``append`` goes to this replica's copy only."""


class TakenOver(trio.ClosedResourceError):
    """A newer reader took the stream over: this reader gets no more events."""


class WriterGone(trio.ClosedResourceError):
    """The replica generating the stream a ``RemoteReader`` follows died (its writer
    lease lapsed): an ``attach`` after ``position`` takes the stream over (failover)."""

    def __init__(self, message: str, position: int) -> None:
        super().__init__(message)
        self.position = position
