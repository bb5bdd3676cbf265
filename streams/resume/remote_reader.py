"""The one reader, on this replica, of a stream another replica generates.

It follows the shared log from event ``after + 1`` until the stream's last event,
holding the stream's reader lease (renewed before each read of the store, where it
finds the lease taken over; released by ``close``). When a read comes back empty while
the writer lease is gone, the writer died: ``WriterGone`` tells the app where to attach
again, which takes the stream over (``failover.py``). An event that fails its check
(``StoreRejected``: altered in the store, or written with another resume secret) is
never passed on: the reader ends with the app's refusal event instead (``refusing``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

from .errors import StoreRejected, TakenOver, WriterGone
from .log import SharedEventLog, StoreUnavailable
from .reader import TAKEN_OVER
from .records import LoggedEvent


class RemoteReader:
    """The reader of a stream another replica generates (see the module docstring).

    Made by ``ResumeRegistry.attach`` only; the same interface as ``Reader``.

    Args:
        token: its reader lease's (None: it holds none, ``refusing``).
        refusal: the event that ends it when the store's events fail their check, of
            the message (None: it ends without one); ``on_rejected`` is told then.
    """

    def __init__(self, log: SharedEventLog, request_id: str, after: int, token: str | None,
                 on_close: Callable[[RemoteReader], None] | None = None, *,
                 refusal: Callable[[str], bytes] | None = None,
                 on_rejected: Callable[[], None] | None = None) -> None:
        self._log = log
        self._on_close = on_close
        self._refusal = refusal
        self._on_rejected = on_rejected
        self._request_id = request_id
        self._pos = after
        self._token = token
        self._pending: deque[tuple[int, bytes, bool]] = deque()
        self._ended = False
        self._closed = False

    @classmethod
    def refusing(cls, log: SharedEventLog, request_id: str, event: bytes) -> RemoteReader:
        """A reader that gives ``event`` (an error event without an id: the store's data
        for the stream is refused here) and then ends; it holds no lease."""
        reader = cls(log, request_id, 0, None)
        reader._refuse(event)
        return reader

    @property
    def request_id(self) -> str:
        return self._request_id

    async def receive(self) -> LoggedEvent:
        """The next event from the shared log, waiting for the writer to append it.

        Raises:
            trio.EndOfChannel: this reader has the stream's last event.
            TakenOver: another reader took the lease over (found at a renewal).
            WriterGone: the writer died; ``attach`` again to take the stream over.
            trio.ClosedResourceError: closed, the log is gone (expired or deleted: the
                writer ended the stream without a last event), or the store did not
                answer (or an event failed its check, and no ``refusal`` was given:
                with one, that event is returned last instead).

        Cancellation: nothing to undo at every checkpoint: an event leaves ``_pending``
        only when returned, and a read cancelled in flight (abandoned to its thread) is
        read again from the same position.
        """
        await trio.lowlevel.checkpoint()
        log, token = self._log, self._token
        while not self._pending:
            if self._closed:
                raise trio.ClosedResourceError("the reader was closed")
            if self._ended:
                raise trio.EndOfChannel
            assert token is not None  # only a refusing reader has none, and it has ended
            try:
                # Before every read of the store (one round trip a batch of events): a
                # reader taken over stops at once, not at a renewal seconds later.
                if not await log.renew_reader(self._request_id, token):
                    if await log.tail(self._request_id) is None:  # the writer forgot it
                        raise trio.ClosedResourceError("the stream's log is gone")
                    raise TakenOver(TAKEN_OVER)
                events = await log.read_remote(self._request_id, self._pos,
                                               wait_s=log.lease_s / 5)
                if not events and not await log.writer_alive(self._request_id):
                    # Its writer died: an attach (the body's, or the client's when it
                    # comes back) takes the stream over, here or on another replica.
                    raise WriterGone("the stream's owner is gone", self._pos)
            except StoreUnavailable as exc:  # the client comes back, maybe elsewhere
                raise trio.ClosedResourceError(str(exc)) from exc
            except StoreRejected as exc:  # never passed on
                if self._on_rejected is not None:
                    self._on_rejected()
                if self._refusal is None:
                    raise trio.ClosedResourceError(str(exc)) from exc
                self._refuse(self._refusal(str(exc)))
                break
            if events is None:
                raise trio.ClosedResourceError("the stream's log is gone")
            self._pending.extend(e for e in events if e[0] > self._pos)
            if self._pending:
                self._ended = self._pending[-1][2]
        if self._closed:
            raise trio.ClosedResourceError("the reader was closed")
        n, data, _ = self._pending.popleft()
        self._pos = max(self._pos, n)
        return LoggedEvent(n, data, None)

    def _refuse(self, event: bytes) -> None:
        """End with ``event``, outside the stream's numbering (n 0)."""
        self._pending = deque([(0, event, True)])
        self._ended = True

    def close(self) -> None:
        """Let the lease go (queued); a ``receive`` in progress raises
        ``ClosedResourceError`` once its read of the store returns (within its wait).
        Sync, idempotent, never a checkpoint."""
        if not self._closed:
            self._closed = True
            if self._token is not None:
                self._log.release_reader(self._request_id, self._token)
            if self._on_close is not None:
                self._on_close(self)
