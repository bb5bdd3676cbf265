"""A stream's plain data: its states, how it ended, its terminal error, its snapshot
(``stream.py`` owns the behaviour and explains each)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from engine import FinishEvent, TokenEvent

from .error_type import ErrorType


class StreamState(enum.Enum):
    """Where a stream is in its life; the engine's share of it is in each comment."""

    WAITING = "waiting"  # submitted; the engine holds it; no token yet (counts for max_waiting)
    STREAMING = "streaming"  # the engine generates; tokens flow into the queue
    ENDED = "ended"  # terminal item queued; the engine is done or asked to cancel
    CLOSED = "closed"  # close() ran: unregistered, queue discarded; nothing more happens


class StreamEnd(enum.Enum):
    """How a stream ended; ``stream.py``'s module docstring says who causes each."""

    FINISHED = "finished"  # the engine's FinishEvent: eos, length or stop
    CLIENT_GONE = "client_gone"  # close() before the end: scope cancelled or reader gave up
    ERROR = "error"  # StreamError slow_client or engine_error
    SHUTDOWN = "shutdown"  # StreamError shutdown after the grace period


@dataclass(frozen=True, slots=True)
class StreamError:
    """A terminal item: the stream ends without a FinishEvent."""

    type: ErrorType  # slow_client, engine_error, shutdown, resume_log_full, deadline_missed
    message: str


StreamItem = TokenEvent | FinishEvent | StreamError


@dataclass(frozen=True, slots=True)
class StreamStatistics:
    """A snapshot of one stream."""

    state: StreamState
    end: StreamEnd | None  # None until the stream ends
    queued: int  # items waiting for the reader
    delivered: int  # items the reader took
    discarded: int  # backlog thrown away when the hub queued a StreamError
    is_paused: bool  # the engine was asked to leave the sequence out of decode
    stall_deadline: float | None  # Trio time the reader is dropped unless it catches up
