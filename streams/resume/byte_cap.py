"""The server-wide cap on the log bytes of resumable streams that no reader holds.

A detached stream generates on with nobody reading it, so its log is the one memory a
client can make the server hold without reading: the bytes of every detached stream
(running or finished) count against ``max_detached_bytes``. The entry asks before it
logs an event while detached (``would_overflow``) and ends its stream instead when the
event would pass the cap (``resume_log_full``, counted here as an overflow). Only
counting lives here; the entries decide.
"""

from __future__ import annotations


class ByteCap:
    """Log bytes of every resumable stream held, and of the detached ones, capped."""

    def __init__(self, max_detached_bytes: int) -> None:
        self.max_detached_bytes = max_detached_bytes
        self.log_bytes = 0  # in the logs of every stream held
        self.detached_bytes = 0  # in the logs of the detached ones
        self.overflows = 0  # streams ended for the cap

    def would_overflow(self, extra: int = 0) -> bool:
        """Whether ``extra`` more detached bytes would pass the cap."""
        return self.detached_bytes + extra > self.max_detached_bytes

    def logged(self, size: int, *, detached: bool) -> None:
        """A stream's log grew by ``size`` bytes."""
        self.log_bytes += size
        if detached:
            self.detached_bytes += size

    def freed(self, size: int) -> None:
        """A stream's log was expired (or disowned): ``size`` bytes gone."""
        self.log_bytes -= size

    def detached(self, size: int) -> None:
        """A stream whose log holds ``size`` bytes lost its reader."""
        self.detached_bytes += size

    def attached(self, size: int) -> None:
        """A detached stream whose log holds ``size`` bytes got a reader (or was
        forgotten)."""
        self.detached_bytes -= size

    def overflowed(self) -> None:
        self.overflows += 1
