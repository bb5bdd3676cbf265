"""The statistics the engine publishes at each step boundary: ``Engine.statistics()``.

Other threads (the server's ``/stats``, its gauges, the tests) read the engine's state
while a step may be running, so they never read the scheduler or the allocator
themselves: the stepping thread builds one frozen ``EngineStatistics`` from them at a
step boundary (and before a step hands events to its ``on_prefill``, so a finish its
reader has seen is always counted) and replaces the published one whole. Reading it
never waits for a step. The counts come from the allocator (blocks), the scheduler
(sequences, preemptions, per band too, the prefix cache's counters), the step costs (the margin of a
step-time target), the step timing and the last step's plan. The stepping thread only;
no torch.
"""

from __future__ import annotations

from typing import Any

from .priority import waiting_by_band
from .scheduler import Scheduler, StepPlan
from .step_timing import StepTiming
from .types import EngineStatistics


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
    """Per band (``engine.priority``): waiting now, mean queue wait, preemptions."""
    residency = scheduler.residency
    bands = residency.bands
    return {"waiting_by_band": waiting_by_band(scheduler.waiting),
            "wait_ms_by_band": bands.mean_wait_ms(),
            "preemptions_by_band": tuple(sorted(bands.preempted.items())),
            "priority_preemptions": residency.num_priority_preemptions}


def plan_statistics(plan: StepPlan) -> dict[str, Any]:
    """What a step's passes ran, as ``EngineStatistics`` names it (``last_step_*``)."""
    return {"last_step_decoded": len(plan.decode),
            "last_step_prefilled": sum(c.end - c.start for c in plan.prefill),
            "last_step_prefill_ids": tuple(c.seq.request_id for c in plan.prefill)}
