"""One round of the engine: what ``Engine.step()`` does, run by its one caller.

Why a module of its own: the engine's other methods are its thread-safe front door
(they only record a wish, ``engine.py``); a round is the one place where sequences and
the cache change, in this order:

1. apply the inbox: submits join the waiting queue (one resumed from tokens made
   elsewhere replays them silently and its generator is advanced past their draws),
   cancels finish a waiting sequence (never admitted) or a running one (blocks
   released), pauses and resumes flip a flag; a request past its ``ttft_deadline``
   whose prefill has not begun finishes with DEADLINE; with ``on_prefill``, the
   finishes go out at once;
2. schedule: admit waiting sequences in arrival order while there are batch
   slots and blocks, and choose the admitted prompts to prefill, in arrival
   order, up to ``max_prefill_tokens`` prompt tokens (the rest next step);
3. prefill the chosen prompts in ONE forward pass and sample each first token;
   with ``on_prefill`` these events go out as soon as that pass is done;
4. decode one token for every other running, unpaused sequence in ONE batched
   forward pass; with ``mixed_step`` (the default), steps 3 and 4 are ONE forward
   pass, the prompt chunks packed and then one row per decoding sequence (as
   vLLM and Sarathi-Serve do), so a step pays the model's per-pass cost once, and
   with ``on_prefill`` all of that pass's events go out as soon as it is done;
5. return the events: tokens, and finishes with a reason.

Then it clocks the step and publishes the boundary: the statistics other threads read
(``boundary_statistics``, below; also before events are handed to ``on_prefill``, so a
finish its reader has seen is always counted) and the TTFT estimate's view of the queue.

The statistics: ``Engine.statistics()``. Other threads (the server's ``/stats``, its
gauges, the tests) read the engine's state while a step may be running, so they never
read the scheduler or the allocator themselves: the stepping thread builds one frozen
``EngineStatistics`` from them at a step boundary and replaces the published one whole.
Reading it never waits for a step. The counts come from the allocator (blocks), the
scheduler (sequences, preemptions, per band too, the prefix cache's counters), the step
costs (the margin of a step-time target), the step timing and the last step's plan.

Failures. A failure tied to one sequence (its sampling, its detokenizer or stop
matcher) finishes that sequence alone with ``ERROR`` and a message. A failed
packed prefill is retried one prompt at a time, so it ends only the prompts that
fail alone; a failed decode pass finishes the sequences in that batch (``StepPasses``).
Either way the step goes on and returns normally. Every event is handed out exactly
once, in ``on_prefill`` or in the return value: if ``on_prefill`` raises, the
step stops there and the exception propagates, and every event made until then
was already handed to it (the rest of the step runs next time). No torch here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from .errors import StepReentered
from .model_side import Runner
from .passes import StepPasses
from .priority import waiting_by_band
from .scheduler import Scheduler, StepPlan
from .step_timing import StepTiming
from .ttft import TtftEstimator
from .types import EngineEvent, EngineStatistics

PrefillCallback = Callable[[list[EngineEvent]], None]


class StepRound:
    """Runs the engine's rounds (see the module docstring) and publishes each boundary.

    Args:
        scheduler: the sequences, their blocks and the step's plan.
        runner: the model side the passes run on.
        timing: clocks the steps.
        ttft: the first-token estimator, told of each boundary.
    """

    def __init__(self, scheduler: Scheduler, runner: Runner, timing: StepTiming,
                 ttft: TtftEstimator) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.passes = StepPasses(runner, scheduler)
        self.timing = timing
        self._ttft = ttft
        self._lock = threading.Lock()  # one step at a time
        self.statistics: EngineStatistics
        self.publish_boundary()

    def run(self, on_prefill: PrefillCallback | None = None) -> list[EngineEvent]:
        """One round; ``Engine.step``'s contract."""
        scheduler = self.scheduler
        with self._stepping() as started:
            events: list[EngineEvent] = []
            early = (events.extend if on_prefill is None
                     else partial(self._pass_prefill_events, on_prefill))
            early(scheduler.apply_inbox())
            for seq in scheduler.take_resumed():  # their tokens' draws, once
                self.runner.advance_generator(seq.generator, seq.generated_ids)
            early(scheduler.expire_deadlines(scheduler.clock()))
            plan = scheduler.schedule()
            if scheduler.mixed_step and plan.prefill and plan.decode:
                early(self.passes.mixed(plan.prefill, plan.decode))  # all out at once
            else:
                early(self.passes.prefill(plan.prefill))
                events += self.passes.decode(plan.decode)
            self._record_step(started, plan)
            return events

    def publish_boundary(self, plan: StepPlan | None = None) -> None:
        """A step boundary, as other threads see it: the TTFT estimate's view of the
        queue and the statistics, replaced together (``plan``: the step that ended)."""
        self._ttft.observe_boundary()
        self.statistics = boundary_statistics(self.scheduler, self.timing, plan)

    @contextmanager
    def _stepping(self) -> Iterator[float]:
        """Hold the step lock (StepReentered if taken); give the step's start time."""
        if not self._lock.acquire(blocking=False):
            raise StepReentered("step() is already running in another thread")
        try:
            yield time.perf_counter()
        finally:
            self._lock.release()

    def _pass_prefill_events(self, on_prefill: PrefillCallback, events: list[EngineEvent]) -> None:
        """Give ``events`` (if any) to ``on_prefill`` with the statistics brought up to
        date first: whoever sees a finish then also sees its blocks released."""
        if events:
            self.publish_boundary()
            on_prefill(events)

    def _record_step(self, started: float, plan: StepPlan) -> None:
        elapsed_ms = self.timing.record(
            started, decode_only=bool(plan.decode and not plan.prefill),
            sequences_left=self.scheduler.num_decoding > 0,
        )
        if plan.planned_ms is not None:
            self.scheduler.costs.observe_step(plan.planned_ms, elapsed_ms)
        self.publish_boundary(plan)


def boundary_statistics(scheduler: Scheduler, timing: StepTiming,
                        plan: StepPlan | None = None) -> EngineStatistics:
    """The engine's state now, between steps; with ``plan``, the step that just ended
    (else, at a hand-over inside a step or before the first, its ``last_step_*`` are
    0 and ``()``)."""
    allocator = scheduler.allocator
    return EngineStatistics(
        blocks_total=allocator.num_blocks,
        blocks_free=allocator.num_free,
        blocks_reserved=allocator.num_reserved,
        blocks_filled=scheduler.num_blocks_filled,
        preemptions=scheduler.num_preemptions,
        recomputed_tokens=scheduler.num_recomputed_tokens,
        step_margin=scheduler.costs.margin(),
        **scheduler.prefix.statistics(),  # the prefix cache's counters
        running=len(scheduler.running),
        waiting=len(scheduler.waiting),
        paused=scheduler.num_paused,
        admitted=scheduler.num_admitted,
        releases=allocator.num_releases,
        steps=timing.steps,
        last_step_ms=timing.last_step_ms,
        median_decode_step_ms=timing.median_decode_step_ms(),
        step_target_ms=scheduler.max_step_ms, **({} if plan is None else plan_statistics(plan)),
        **band_statistics(scheduler),
    )


def band_statistics(scheduler: Scheduler) -> dict[str, Any]:
    """Per band (``engine.priority``): waiting now, mean queue wait, preemptions, the
    longest queue wait in steps and admissions by aging (``engine.aging``)."""
    residency = scheduler.residency
    bands = residency.bands
    return {"waiting_by_band": waiting_by_band(scheduler.waiting),
            "wait_ms_by_band": bands.mean_wait_ms(),
            "preemptions_by_band": tuple(sorted(bands.preempted.items())),
            "priority_preemptions": residency.num_priority_preemptions,
            "longest_wait_steps_by_band": tuple(sorted(bands.longest_wait_steps.items())),
            "aged_admissions_by_band": tuple(sorted(bands.aged.items()))}


def plan_statistics(plan: StepPlan) -> dict[str, Any]:
    """What a step's passes ran, as ``EngineStatistics`` names it (``last_step_*``)."""
    return {"last_step_decoded": len(plan.decode),
            "last_step_prefilled": sum(c.end - c.start for c in plan.prefill),
            "last_step_prefill_ids": tuple(c.seq.request_id for c in plan.prefill)}
