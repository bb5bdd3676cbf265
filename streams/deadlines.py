"""TTFT deadlines: refusing a request whose first token cannot come in time, and waking
the idle step loop when a deadline of a request in the engine passes.

A request with a ``ttft_deadline`` is refused at ``open_stream`` when the engine's
estimate of its first token is later (``DeadlineUnmeetable``: before anything opens,
without waiting for a step). One admitted but still unstarted at its deadline is let go
by the engine (FinishReason.DEADLINE) at a step, so the hub's idle loop must step then:
``until_next`` says when. ``refused`` and ``misses`` count both.
"""

from __future__ import annotations

import math
import time

from engine import FinishEvent, FinishReason, GenerationRequest

from .errors import DeadlineUnmeetable
from .hub_types import StepEngine

# After a TTFT deadline, how long an idle step loop waits before it looks again: the
# deadline is strict (``<``), and a timer may fire a hair early.
DEADLINE_MARGIN_S = 0.001


class TtftDeadlines:
    """The TTFT deadlines of the requests in the engine (see the module docstring)."""

    def __init__(self, engine: StepEngine) -> None:
        self._engine = engine
        self._deadlines: dict[str, float] = {}  # in the engine, with a ttft_deadline
        self.refused = 0  # open_stream refusals: the estimate missed the deadline
        self.misses = 0  # requests the engine let go at their deadline, never run

    def check(self, request: GenerationRequest) -> None:
        """Raise DeadlineUnmeetable if the engine's estimate says the first token cannot
        come by ``request.ttft_deadline`` (time.monotonic() seconds; None: no check),
        counting its ``prompt_token_ids`` but those the engine has cached (none given:
        none counted, a lower bound, so a caller may check before encoding the prompt).
        Sync, never waits a step: it
        reads the engine's last step boundary."""
        deadline = request.ttft_deadline
        if deadline is None:
            return
        left_ms = (deadline - time.monotonic()) * 1000
        ids = request.prompt_token_ids
        estimate = self._engine.estimate_ttft_ms(len(ids or ()), ids or (),
                                                 request.cache_namespace, request.priority)
        if left_ms <= 0 or (estimate is not None and estimate > left_ms):
            self.refused += 1
            raise DeadlineUnmeetable(estimate, left_ms)

    def submitted(self, request: GenerationRequest) -> None:
        if request.ttft_deadline is not None:
            self._deadlines[request.request_id] = request.ttft_deadline

    def finished(self, event: FinishEvent) -> None:
        self._deadlines.pop(event.request_id, None)
        if event.reason is FinishReason.DEADLINE:
            self.misses += 1

    def until_next(self) -> float:
        """Seconds to the next TTFT deadline still ahead (inf: none), so that an idle loop
        steps then: a request still waiting at its deadline makes has_work() True."""
        now = time.monotonic()
        ahead = [d for d in self._deadlines.values() if d > now]
        return min(ahead) - now + DEADLINE_MARGIN_S if ahead else math.inf
