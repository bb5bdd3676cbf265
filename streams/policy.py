"""Slow-reader policies: what happens to a stream whose reader falls behind the engine.

This module owns the decisions and nothing else: pure, synchronous functions of a
stream's queue length, its ``Lag`` and the time. It knows no engine, no Trio and no
stream; ``stream.py`` applies the decisions (asks the engine to pause, resume or
cancel) and the hub's watchdog asks ``is_overdue`` when a stall deadline passes.

Each policy chooses who bears the cost of a slow reader (see the reference chapter,
"A client that cannot keep up"):

    unbounded   memory: the queue grows without limit; bounded by max_new_tokens
    pause       the slow request's own slot: at ``queue_limit`` queued items the
                sequence leaves the decode batch, keeping its cache blocks and slot
    drop        the slow request itself: ``queue_limit`` behind for longer than
                ``stall_timeout_s`` and it is cancelled in the engine, its unsent
                backlog is discarded and the reader's next item is StreamError
                ``slow_client`` (the hub's watchdog acts at the deadline, even
                while the step loop sleeps)
    pause-drop  pause at ``queue_limit``, drop if still behind after the timeout

(The lab's ``naive``, where everyone pays because the step loop waits for the reader,
is no policy of the service: ``tools/lab`` installs it as the hub's ``run_step``.)

"Behind" starts when the queue reaches ``queue_limit`` items and ends when the
reader has caught up to ``low_water`` (``queue_limit // 2``) items. The gap between
the two is hysteresis: a resumed stream refills half its queue before it is paused
again, instead of pausing and resuming on every token. Once the engine is done with a
stream (its terminal item is queued) no policy acts on it: it holds nothing to release,
and its backlog is bounded by ``max_new_tokens``. ``queue_limit`` is soft by
at most one step: the pause is applied at the engine's next step, so the step in
flight may add one more event.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class PolicyName(enum.Enum):
    """The slow-reader policies; values are the names used in settings."""

    UNBOUNDED = "unbounded"
    PAUSE = "pause"
    DROP = "drop"
    PAUSE_DROP = "pause-drop"


_PAUSING = frozenset({PolicyName.PAUSE, PolicyName.PAUSE_DROP})
_DROPPING = frozenset({PolicyName.DROP, PolicyName.PAUSE_DROP})


@dataclass(frozen=True, slots=True)
class Lag:
    """What a policy has done so far about one stream's reader being behind."""

    is_paused: bool = False  # the engine was asked to leave the sequence out of decode
    stall_deadline: float | None = None  # Trio time of the drop unless the reader catches up


CAUGHT_UP = Lag()


@dataclass(frozen=True, slots=True)
class Policy:
    """One policy with its limits. Every method is pure and never blocks.

    Args:
        name: which policy.
        queue_limit: queued items at which a reader counts as behind (>= 1).
        stall_timeout_s: how long a reader may stay behind before a dropping
            policy drops it (> 0).

    Raises:
        ValueError: if a limit is out of range.
    """

    name: PolicyName
    queue_limit: int = 32
    stall_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.queue_limit < 1:
            raise ValueError(f"queue_limit must be >= 1, not {self.queue_limit}")
        if not (0 < self.stall_timeout_s < math.inf):
            raise ValueError(f"stall_timeout_s must be finite and > 0, not {self.stall_timeout_s}")

    @property
    def low_water(self) -> int:
        """Queued items at or below which a reader has caught up."""
        return self.queue_limit // 2

    def after_put(self, lag: Lag, queued: int, now: float) -> Lag:
        """The lag after an item was queued, leaving ``queued`` items."""
        if queued < self.queue_limit or self.name not in _PAUSING | _DROPPING:
            return lag
        deadline = lag.stall_deadline
        if deadline is None and self.name in _DROPPING:
            deadline = now + self.stall_timeout_s
        return Lag(is_paused=lag.is_paused or self.name in _PAUSING, stall_deadline=deadline)

    def after_take(self, lag: Lag, queued: int) -> Lag:
        """The lag after the reader took an item, leaving ``queued`` items."""
        return CAUGHT_UP if queued <= self.low_water else lag

    def is_overdue(self, lag: Lag, now: float) -> bool:
        """True if a stalled reader's time is up and the stream must be dropped."""
        return lag.stall_deadline is not None and now >= lag.stall_deadline
