"""The event log of resumable streams: what a reader that comes back replays.

Owns the encoded events of each resumable stream, numbered from 1 in the order they
were made, and nothing else: it knows no Trio, no engine and no HTTP. ``EventLog`` is
the interface the resumption registry (``resumption.py``) uses; ``MemoryEventLog``, a
dict of lists in this process, is the default. A shared store (Redis streams, for
several replicas serving one client population: issue 11) implements the same three
operations.

Synchronous on purpose: a live event is taken from its stream and logged with no
checkpoint between (``resumption.py``), so no cancel can lose one. A networked store
keeps that property by appending to a local buffer that a task of its own flushes;
``read_after`` then reads the buffer's tail after the store's.

Bounds: the log does not limit itself. The registry gives each stream at most its own
events (a start, at most ``max_new_tokens`` tokens, one last event) and caps the bytes
of the streams no reader holds (``resume_max_bytes``).
"""

from __future__ import annotations

from typing import Protocol


class EventLog(Protocol):
    """Encoded events per stream id, numbered 1, 2, ...; every method sync, no checkpoint."""

    def append(self, stream_id: str, n: int, data: bytes) -> None:
        """Store event ``n`` of ``stream_id`` (a new stream starts at 1).

        Raises:
            ValueError: ``n`` is not the stream's next number (the log never has a gap
                or a duplicate).
        """
        ...

    def read_after(self, stream_id: str, n: int) -> list[bytes] | None:
        """Events ``n+1``, ``n+2``, ... of ``stream_id`` in order; None for a stream the
        log does not hold (never appended to, or expired)."""
        ...

    def expire(self, stream_id: str) -> int:
        """Forget ``stream_id``'s events; return the bytes freed (0 if none). Idempotent."""
        ...


class MemoryEventLog:
    """``EventLog`` in this process's memory: one list of bytes per stream."""

    def __init__(self) -> None:
        self._events: dict[str, list[bytes]] = {}
        self._bytes: dict[str, int] = {}

    def append(self, stream_id: str, n: int, data: bytes) -> None:
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
