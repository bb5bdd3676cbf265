"""The hub's refusals: raised by ``Hub.open_stream`` before anything opens.

    HubError
    ├── NotAccepting            the hub is not running (not started, shutting down,
    │                           stopped, or failed); nothing was submitted
    ├── WaitingLimitReached     ``max_waiting`` streams already wait for their first
    │                           token; nothing was submitted; ``retry_after_s`` is a hint
    └── DeadlineUnmeetable      the engine's estimate of the first token's time is past
                                the request's ``ttft_deadline``; nothing was submitted

``open_stream`` also lets the engine's own ``engine.InvalidRequest`` (and its
subclasses) through unchanged: the request can never be served as given.

What goes wrong after a stream has opened is not an exception: the reader gets a
``StreamError`` item (``slow_client``, ``engine_error``, ``shutdown``) from
``TokenStream.receive``; see ``stream.py``.
"""

from __future__ import annotations

# A refused deadline's Retry-After, in seconds: the overshoot rounded up to one of these,
# so that the answer tells a client roughly how long to wait and nothing finer (a
# precise figure would say how much of a prompt is cached: docs/security.md).
RETRY_AFTER_BUCKETS_S = (1, 2, 4, 8, 16, 32, 64)


class HubError(Exception):
    """Base of the hub's refusals."""


class NotAccepting(HubError):
    """The hub does not accept streams now; ``state`` says why (a ``HubState`` value)."""

    def __init__(self, state: str) -> None:
        super().__init__(f"the hub is not accepting streams (state: {state})")
        self.state = state


class WaitingLimitReached(HubError):
    """Too many streams wait for their first token; try again after ``retry_after_s``."""

    def __init__(self, max_waiting: int, retry_after_s: float) -> None:
        super().__init__(f"{max_waiting} streams are already waiting for their first token")
        self.max_waiting = max_waiting
        self.retry_after_s = retry_after_s


class DeadlineUnmeetable(HubError):
    """The first token would come after the request's deadline, by the engine's estimate.

    ``estimate_ms``: the engine's estimate from now (None: nothing measured yet, and the
    deadline had passed already), for the process only: the message leaves it out, since
    it counts the request's cached prefix and a client could read from it whether a
    prompt is cached; ``left_ms``: the time left to the deadline (also left out: it
    varies with the server's work before the check); ``retry_after_s``: how
    much the estimate overshoots it, rounded up to a ``RETRY_AFTER_BUCKETS_S`` bucket.
    """

    def __init__(self, estimate_ms: float | None, left_ms: float) -> None:
        super().__init__("by the server's estimate, the first token cannot come before the "
                         "request's deadline")
        self.estimate_ms = estimate_ms
        self.left_ms = left_ms
        over_s = max((estimate_ms or 0.0) - left_ms, 0.0) / 1000
        self.retry_after_s = float(next((b for b in RETRY_AFTER_BUCKETS_S if over_s <= b),
                                        RETRY_AFTER_BUCKETS_S[-1]))
