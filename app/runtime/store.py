"""The resumable streams' log: which one the settings choose, and whether it answers.

Memory by default; with ``STREAMSCOPE_RESUME_STORE``, a Redis that several replicas share
(``streams.resume.RedisEventLog``, whose module and redis-py load only then).
"""

from __future__ import annotations

import trio

import streams.resume
from streams.resume import EventLog, MemoryEventLog, ResumeRegistry

from ..errors import ApiError, ErrorType
from ..settings import Settings
from .phase import LOADING_RETRY_AFTER_S

# /ready asks the shared resume store (Redis) for an answer this long at most: a health
# check (HAProxy's, every second) must not hang on a store that does not answer.
STORE_CHECK_TIMEOUT_S = 0.5


def resume_log(settings: Settings) -> EventLog:
    """The log of resumable streams the settings choose: memory, or a shared Redis whose
    keys outlive their owner by the grace period, what the replicas write to it signed
    with their shared secret, and its queue bounded."""
    if settings.resume_store is None:
        return MemoryEventLog()
    assert settings.resume_secret is not None  # the settings refuse a store without one
    return streams.resume.RedisEventLog.from_url(
        settings.resume_store, secret=settings.resume_secret, ttl_s=settings.resume_grace_s,
        writer_lease_s=settings.writer_lease_s, max_pending=settings.resume_store_queue)


async def store_refusal(registry: ResumeRegistry | None) -> ApiError | None:
    """With a shared store: 503 ``unavailable`` when it does not answer within
    ``STORE_CHECK_TIMEOUT_S`` (``/ready``: a balancer takes this replica out, for a
    resume of another replica's stream would fail here); None when it answers or there
    is none (``registry`` None: no hub yet; the memory log always answers).

    Cancellation: the answer is not waited for (the ask is abandoned to its thread).
    """
    if registry is None:
        await trio.lowlevel.checkpoint()
        return None
    with trio.move_on_after(STORE_CHECK_TIMEOUT_S):
        if await registry.store_answers():
            return None
    return ApiError(ErrorType.UNAVAILABLE, "the shared resume store "
                    "(STREAMSCOPE_RESUME_STORE) does not answer",
                    retry_after_s=LOADING_RETRY_AFTER_S)
