"""The hub's plain data: the engine Protocol it drives, its states, settings and statistics.

Kept apart from ``hub.py`` so that the hub module holds only behaviour. Nothing here
runs or waits.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine import EngineEvent, EngineStatistics, GenerationRequest

from .policy import Policy, PolicyName

OnPrefill = Callable[[list[EngineEvent]], None]
# Runs the stepping thread's function (``Stepper.run_steps``: True if its last step was
# empty) once: ``trio.to_thread.run_sync``, or in tests inline after some virtual time.
RunStep = Callable[[Callable[[], bool]], Awaitable[bool]]


class StepEngine(Protocol):
    """The engine as the hub uses it; ``engine.Engine`` and the test fake satisfy it.

    Beyond the signatures: submit/cancel/pause/resume are thread-safe wishes applied at
    the next step, and the last three ignore unknown or finished ids; each submitted
    request yields exactly one FinishEvent; ``on_prefill`` runs in the stepping thread
    with no engine lock held (the hub may call cancel or pause while handling it). Every
    event is handed out once, to ``on_prefill`` (the finishes of cancels applied at the
    step's start, then each prefill's) or in the return value; if ``on_prefill`` raises,
    the step raises that after handing it everything made so far, and makes no more.
    A failure tied to one request ends it alone (FinishEvent ``ERROR``); a step raises
    only for a raising ``on_prefill`` or a bug.
    """

    def submit(self, request: GenerationRequest, resume_from: Sequence[int] = ()) -> int: ...
    def cancel(self, request_id: str) -> None: ...
    def pause(self, request_id: str) -> None: ...
    def resume(self, request_id: str) -> None: ...
    def step(self, on_prefill: OnPrefill | None = None) -> list[EngineEvent]: ...
    def has_work(self) -> bool: ...
    def statistics(self) -> EngineStatistics: ...
    def estimate_ttft_ms(self, prompt_tokens: int, prompt_ids: Sequence[int] = (),
                         cache_namespace: bytes = b"", priority: int = 0) -> float | None:
        """ms until a request of ``prompt_tokens`` submitted now gets its first token,
        or None before the engine measured anything; given the prompt's ids, what of
        them is cached (prefix caching) in the request's ``cache_namespace`` is not
        counted; in band ``priority``, lower bands are behind it and preemptible.
        Thread-safe; never waits a step."""
        ...


class HubState(enum.Enum):
    """Where the hub is in its life; ``open_stream`` accepts only while RUNNING."""

    NEW = "new"  # made; run() not started; open_stream refuses
    RUNNING = "running"  # the step loop runs; open_stream accepts
    DRAINING = "draining"  # drain(): refusing; open streams finish or meet the grace deadline
    STOPPED = "stopped"  # run() is over; after shutdown() the engine holds none of our requests
    FAILED = "failed"  # a step raised; every stream got engine_error; refusing


@dataclass(frozen=True, slots=True)
class HubSettings:
    """The hub's policy and limits; the constructor raises ValueError for one out of range."""

    policy: PolicyName = PolicyName.PAUSE_DROP
    queue_limit: int = 32  # items queued before a reader counts as behind
    stall_timeout_s: float = 10.0  # behind this long and a dropping policy drops the reader
    max_waiting: int = 256  # streams without their first token yet; more are refused
    waiting_retry_after_s: float = 1.0  # the hint given with WaitingLimitReached
    shutdown_grace_s: float = 5.0  # how long drain() lets open streams finish

    def __post_init__(self) -> None:
        """Every limit, checked here once (the app's settings check theirs by building one).

        Raises:
            ValueError: naming the first limit out of range.
        """
        Policy(self.policy, self.queue_limit, self.stall_timeout_s)  # the policy's limits
        if isinstance(self.max_waiting, bool) or self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, not {self.max_waiting!r}")
        if not 0 <= self.shutdown_grace_s < math.inf:
            raise ValueError(f"shutdown_grace_s must be finite and >= 0, not "
                             f"{self.shutdown_grace_s!r}")
        if not 0 <= self.waiting_retry_after_s < math.inf:
            raise ValueError(f"waiting_retry_after_s must be finite and >= 0, not "
                             f"{self.waiting_retry_after_s!r}")


@dataclass(frozen=True, slots=True)
class HubStatistics:
    """A snapshot of the hub, for /stats and tests; counters count since construction."""

    state: HubState
    streams_open: int  # registered: opened and not yet closed
    waiting: int  # open streams without their first token
    paused_streams: int  # open streams the engine was asked to leave out of decode
    engine_requests: int  # submitted here, FinishEvent not yet seen: cache not whole if > 0
    opened: int
    closes: int  # close() calls that did work (one per stream)
    refused_waiting: int  # open_stream refusals by max_waiting
    refused_deadline: int  # open_stream refusals: the estimate missed the TTFT deadline
    deadline_misses: int  # streams the engine let go at their TTFT deadline, never run
    steps: int
    step_errors: int  # steps that raised (the hub stops at the first)
    last_error: str | None  # repr of the exception a step raised
    events_routed: int  # engine events queued to a stream
    events_dropped: int  # engine events for a closed or ended stream
    slow_client_drops: int
    loop_wait_s: float = 0.0  # the stepping thread's waits for the loop to route its steps
