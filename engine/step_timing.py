"""How long steps take, and how the caller's loop paces them.

Two numbers, both measured by the stepping thread at the end of each step and read by
any thread (``Engine.statistics``, ``ttft.TtftEstimator``): a step's own time, from
its start to its end (its passes plus the scheduler's Python), and the period between
the starts of consecutive steps while sequences ran. The period is the step as the
caller's loop paces it (its own work between steps, a busy event loop, the GIL
included), which a forward pass's time alone leaves out: a TTFT estimate that knew
only the passes would promise first tokens sooner than a busy server gives them.
Readers see each number as the last step left it (a float's assignment is atomic).
"""

from __future__ import annotations

import statistics as stats
import time
from collections import deque

# Each new step period's weight in the moving average the TTFT estimate paces steps by:
# about the last ten steps, so a burst's slower steps count within a few tokens.
PERIOD_WEIGHT = 0.1
# Decode-only steps whose median ``statistics()`` reports.
DECODE_STEPS_KEPT = 256


class StepTiming:
    """The step clock: written by the stepping thread only (``record``)."""

    def __init__(self) -> None:
        self.steps = 0
        self.last_step_ms: float | None = None
        self.busy_period_ms: float | None = None  # moving average of periods while busy
        self._last_start: float | None = None  # of the last step, if it left sequences
        self._decode_ms: deque[float] = deque(maxlen=DECODE_STEPS_KEPT)

    def record(self, started: float, *, decode_only: bool, sequences_left: bool) -> float:
        """The step that began at ``started`` (``time.perf_counter()``) has ended; its
        milliseconds. ``decode_only``: it decoded and prefilled nothing (its time joins
        the decode steps' median); ``sequences_left``: sequences still decode after it,
        so the next step's start measures a period."""
        elapsed_ms = (time.perf_counter() - started) * 1000
        self.steps += 1
        self.last_step_ms = elapsed_ms
        if self._last_start is not None:  # the last step left sequences running
            period, old = (started - self._last_start) * 1000, self.busy_period_ms
            self.busy_period_ms = period if old is None else old + PERIOD_WEIGHT * (period - old)
        self._last_start = started if sequences_left else None
        if decode_only:
            self._decode_ms.append(elapsed_ms)
        return elapsed_ms

    def median_decode_step_ms(self) -> float | None:
        """The median of the recent decode-only steps; None before any."""
        return stats.median(self._decode_ms) if self._decode_ms else None
