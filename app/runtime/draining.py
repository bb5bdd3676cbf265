"""The end of a drain: wait for the hub to stop, and hand resumable streams over first.

``Runtime.drain()`` (``runtime.py``) refuses new streams and tells the hub to drain;
``finish_drain`` then runs in the app's nursery. ``Hub.drain`` lets the open streams
finish until ``SHUTDOWN_GRACE_S`` from then, ends the rest with a last ``error`` event
``shutdown`` (each end asks the engine to cancel), and steps the engine until it holds
none of our requests: the cache is whole. With a shared resume store, the resumable
streams still running ``HANDOVER_LEAD_S`` before that deadline are handed over instead
(``hand_over_before_deadline``): they stop here without a final event, their events in
the store and their writer leases let go, and a resume on another replica continues them.

hypercorn's own stop comes after the drain or at the same moment (``app/edge/signals.py``
says which); when both start at the signal, ``--graceful-timeout`` must be at least
``SHUTDOWN_GRACE_S`` + ``DRAIN_MARGIN_S`` (1 s), or hypercorn cuts the streams before the
drain ends them. quart-trio puts a deadline of ``BACKGROUND_TASK_SHUTDOWN_TIMEOUT`` on the
app's nursery before ``after_serving`` runs; the factory sets it to ``stop_deadline_s``.
"""

from __future__ import annotations

import logging

import trio

import streams
from streams.resume import ResumeRegistry, StoreUnavailable

from ..settings import Settings
from .loading import ServingEngine

log = logging.getLogger("streamscope.app")

# After the grace period, shutdown still waits for the engine to apply the cancels: one
# or two steps. This bounds that wait generously (a step of a small model on a CPU is
# tens of milliseconds) without letting a wedged engine hold the process forever.
STOP_MARGIN_S = 10.0
# With a shared resume store, a drain hands its resumable streams still running over to
# another replica this long before its deadline (instead of ending them with shutdown):
# before the hub's end at the deadline, with time to ask the store (half of it at most)
# and put their last events in it. A shorter grace period hands them over at once.
HANDOVER_LEAD_S = 0.5


def stop_deadline_s(settings: Settings) -> float:
    """How long ``after_serving`` may take: the grace period and then a few steps."""
    return settings.shutdown_grace_s + STOP_MARGIN_S


async def finish_drain(
    hub: streams.Hub, eng: ServingEngine, registry: ResumeRegistry | None,
    settings: Settings, began: float,
) -> None:
    """Wait for the draining ``hub`` to stop (and for a hand-over of resumable streams to
    the store, ``hand_over_before_deadline``), then say so in the log.

    Cancellation: (the app's nursery, at its shutdown deadline) the remaining streams are
    ended at once by the hub (``Hub.shutdown``), with the same engine cancel as when
    closed by its owner, and Cancelled propagates; the engine applies their cancels
    only if something still steps it.
    """
    hub_stopped = trio.Event()
    handing_over = registry if settings.resume_store is not None else None
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hand_over_before_deadline, handing_over,
                           began + settings.shutdown_grace_s, hub_stopped)
        await hub.shutdown()
        hub_stopped.set()
    stats = eng.statistics()
    log.warning("drained in %.2f s: the engine holds none of our requests; cache whole: "
                "%s, %d of %d blocks free", trio.current_time() - began,
                stats.blocks_free == stats.blocks_total, stats.blocks_free,
                stats.blocks_total)


async def hand_over_before_deadline(
    registry: ResumeRegistry | None, deadline: float, hub_stopped: trio.Event
) -> None:
    """``HANDOVER_LEAD_S`` before the drain's ``deadline``, unless the hub stopped first
    (every stream ended): leave the resumable streams still running to another replica
    (``ResumeRegistry.hand_over``; ``registry`` is None without a shared store: the rest
    end with ``shutdown`` at the deadline as before), and wait (bounded) until the store
    has their events. Not if the store does not answer then: they end with
    ``shutdown``, which their clients can still read here.

    Cancellation: (with the drain's) before the hand-over, nothing changes; after, only
    the wait for the store stops (the streams are handed over).
    """
    with trio.move_on_at(deadline - HANDOVER_LEAD_S):
        await hub_stopped.wait()
    if hub_stopped.is_set() or registry is None:
        return
    answers = False
    with trio.move_on_after(HANDOVER_LEAD_S / 2):
        answers = await registry.store_answers()
    if not answers:
        log.warning("draining: the resume store does not answer; resumable streams "
                    "still running end with shutdown")
        return
    with trio.move_on_at(deadline + HANDOVER_LEAD_S) as waited:
        try:
            handed = await registry.hand_over()
        except StoreUnavailable as exc:
            log.warning("draining: resumable streams handed over, but %s", exc)
            return
    if waited.cancelled_caught:
        log.warning("draining: resumable streams handed over; the store did not "
                    "take their last events in time")
    elif handed:
        log.warning("draining: %d resumable streams handed over to the other "
                    "replicas (a resume takes each over)", handed)
