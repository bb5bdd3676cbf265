"""The resumable streams' log: which one the settings choose, and whether it answers.

Memory by default; with ``STREAMSCOPE_RESUME_STORE``, a Redis that several replicas share
(``streams.resume.RedisEventLog``, whose module and redis-py load only then). The
replica talks to that Redis through one ``streams.resume.RedisStore`` (``shared_store``:
one client on one bounded pool, one signer of the replicas' secret), which the runtime
makes once and hands to the resume log and to the Responses API's store
(``responses_store.py``) alike.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

import streams.resume
from streams.resume import EventLog, MemoryEventLog, ResumeRegistry

from ..errors import ApiError, ErrorType
from ..settings import Settings
from .phase import LOADING_RETRY_AFTER_S

if TYPE_CHECKING:
    from streams.resume import RedisStore

# /ready asks the shared resume store (Redis) for an answer this long at most: a health
# check (HAProxy's, every second) must not hang on a store that does not answer.
STORE_CHECK_TIMEOUT_S = 0.5


def shared_store(settings: Settings) -> RedisStore | None:
    """The replica's one connection to the shared Redis the settings name (its client,
    pool and signer; no connection is made yet), or None without one."""
    if settings.resume_store is None:
        return None
    assert settings.resume_secret is not None  # the settings refuse a store without one
    return streams.resume.RedisStore.from_url(settings.resume_store,
                                              secret=settings.resume_secret)


def resume_log(settings: Settings, shared: RedisStore | None) -> EventLog:
    """The log of resumable streams the settings choose: memory, or the shared Redis
    (``shared``, the settings' ``shared_store``) whose keys outlive their owner by the
    grace period, what the replicas write to it signed with their shared secret, and
    its queue bounded."""
    if shared is None:
        return MemoryEventLog()
    return streams.resume.RedisEventLog.on_store(
        shared, ttl_s=settings.resume_grace_s, writer_lease_s=settings.writer_lease_s,
        max_pending=settings.resume_store_queue)


async def store_refusal(registry: ResumeRegistry | None) -> ApiError | None:
    """With a shared store: 503 ``unavailable`` when it does not answer within
    ``STORE_CHECK_TIMEOUT_S`` (``/ready``: a balancer takes this replica out, for a
    resume of another replica's stream would fail here); None when it answers or there
    is none (``registry`` None: no hub yet; the memory log always answers).

    Cancellation: abandoned: a ping changes nothing, so the caller returns at once and
    the ask runs on in its thread until the store answers or its socket times out.
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
