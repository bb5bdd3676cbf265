"""A resumable stream's reader as the one body's source (``body.py``), and its encoder.

The registry logs a resumable stream's events as they are made (``app.wire``'s
``ResumableEvents``, ids ``<request_id>:<n>``), so a reader's events are bytes already:
``LoggedEvents`` only joins them, and opens a resume with the ``retry`` line. Its
farewell is nothing: a response the server cuts is not the stream's end. By the time
hypercorn cuts connections the drain has ended the stream here (its reader got the
``shutdown`` event from the log) or handed it over to another replica, where the
client, reconnecting, resumes it; a last ``error`` event would stop it instead.
``ResumeSource`` reads a ``Reader`` or ``RemoteReader``: the log after its position,
then live events; ``TAKEN_OVER_EVENT`` last if a newer reader took the stream over. A
remote reader whose writer died (``WriterGone``) is replaced in place by
``registry.attach`` at its position, which takes the stream over (failover): the
client reads on, unaware.
"""

from __future__ import annotations

from streams.resume import LoggedEvent, Reader, RemoteReader, ResumeRegistry, TakenOver, WriterGone

from ..wire import KEEPALIVE_COMMENT, RETRY_LINE, TAKEN_OVER_EVENT
from .body import SourceMoved


class LoggedEvents:
    """An ``app.wire.Encoder`` of logged events: their bytes as they are."""

    def __init__(self, *, send_retry: bool) -> None:
        self._opening = RETRY_LINE if send_retry else b""

    def opening(self) -> bytes:
        return self._opening

    def encode(self, items: list[LoggedEvent]) -> bytes:
        return b"".join(item.data for item in items)

    def error(self, error_type: str, message: str) -> bytes:
        return b""  # no farewell: the stream outlives this response

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT


class ResumeSource:
    """``body.ItemSource`` of one reader of a resumable stream (see the module
    docstring); ``close()`` lets the reader go, which hands the stream back to the
    registry."""

    def __init__(self, reader: Reader | RemoteReader,
                 registry: ResumeRegistry | None = None) -> None:
        self.reader = reader
        self._registry = registry  # None: no failover (the reader is the owner's)
        self._over = False

    def take_ready(self, max_items: int) -> list[LoggedEvent]:
        return []  # each event is read (and logged) by ``receive``

    async def receive_batch(self, max_items: int) -> list[LoggedEvent]:
        """The next event.

        Raises: trio.EndOfChannel or ClosedResourceError at the end (or after
        ``TAKEN_OVER_EVENT``); SourceMoved when the owner died.
        Cancellation: nothing to undo: it lands at ``reader.receive()``, which logs and
        returns an item in one synchronous stretch, so nothing taken is lost.
        """
        if self._over:
            raise TakenOver("taken over")
        try:
            return [await self.reader.receive()]
        except TakenOver:
            self._over = True
            return [LoggedEvent(0, TAKEN_OVER_EVENT, None)]
        except WriterGone as exc:
            position = exc.position

            async def take_over() -> None:
                await self._take_over(position)

            raise SourceMoved(take_over) from None

    async def _take_over(self, position: int) -> None:
        """Attach again after ``position`` (failover, or another remote reader if another
        replica took over first); the body ends (the client resumes) if that fails.

        Cancellation: the old reader is closed already (its stream handed over to the
        registry), so a cancel leaves this source with no reader to lose; inside
        ``ResumeRegistry.attach`` the wait for the holder is finished first (shielded,
        one scheduling round) and a shared log's lease claim abandoned (it lapses).
        """
        self.reader.close()
        if self._registry is None:
            raise StopAsyncIteration
        try:
            self.reader = await self._registry.attach(self.reader.request_id, position)
        except Exception:  # any refusal: the client comes back (Cancelled passes)
            raise StopAsyncIteration from None

    def close(self) -> None:
        self.reader.close()
