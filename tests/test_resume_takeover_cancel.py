"""A takeover cancelled mid-call (issue 34, defect D1): the writer lease is never left held
by a replica that neither writes the stream nor renews the lease.

Real ``redis-server`` on loopback (``tests/test_replicas.py``'s fixture). The cancel is
landed deterministically, with no timer: the take-over script runs for real in its
reader thread, and right after Redis granted the lease, that thread cancels the
resuming request's scope in the Trio thread (``trio.from_thread.run_sync``) before it
returns: exactly a client that leaves, or ``_attach_remote``'s wait that runs out,
while the round trip is in flight.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis
import trio

from streams.resume.byte_cap import ByteCap
from streams.resume.local import LocalStreams
from streams.resume.records import Adopt
from streams.resume.redis_keys import writer_key
from streams.resume.replicas import Replicas
from tests.test_replicas import (  # noqa: F401 (redis_process, redis_url: fixtures)
    redis_log,
    redis_process,
    redis_url,
)

LEASE_S = 30.0  # outlives the test: a lease left behind is still there at the end


class NoRebuild:
    """The app's rebuild, which the cancel comes before."""

    async def __call__(self, request_id: str, spec: bytes,
                       events: list[tuple[int, bytes, bool]], adopt: Adopt) -> None:
        """Never reached. Cancellation: nothing to cancel."""
        raise AssertionError("the cancelled resume went on to rebuild")

    def refusal(self, request_id: str, message: str) -> bytes:
        return b"refused"


async def test_a_takeover_cancelled_after_redis_granted_the_lease_lets_the_lease_go(
    redis_url: str,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    store = redis.Redis.from_url(redis_url)
    dead = redis_log(redis_url, ttl_s=LEASE_S, lease_s=1.0, follow_wait_s=0.1,
                     writer_lease_s=LEASE_S)
    dead.publish("s1", b"spec")
    dead.append("s1", 1, b"start")
    await dead.flush()
    store.delete(writer_key("s1"))  # its writer died: the lease lapsed

    here = redis_log(redis_url, ttl_s=LEASE_S, lease_s=1.0, follow_wait_s=0.1,
                     writer_lease_s=LEASE_S)
    replicas = Replicas(here, LocalStreams(here, here, ByteCap(1 << 20), grace_s=LEASE_S))
    take_over_script = here._take_over
    granted: list[Any] = []

    with trio.CancelScope() as request:
        def granted_then_cancelled(*args: Any, **kwargs: Any) -> Any:
            won = take_over_script(*args, **kwargs)  # Redis's answer: the lease is ours
            granted.append(won)
            trio.from_thread.run_sync(request.cancel)  # the client leaves mid-call
            return won

        monkeypatch.setattr(here, "_take_over", granted_then_cancelled)
        await replicas.attach("s1", 1, NoRebuild())
    assert request.cancelled_caught
    assert granted == [1]  # Redis did grant this replica the lease, mid-call
    await here.flush()  # what the cancelled resume queued (the release) is in Redis
    # Nobody here writes or renews the stream: its lease must not stay this replica's
    # (before the fix it did, for LEASE_S: the stream stalled until it lapsed).
    assert store.get(writer_key("s1")) != here.writer_token.encode()
    other = redis_log(redis_url, ttl_s=LEASE_S, lease_s=1.0, follow_wait_s=0.1,
                      writer_lease_s=LEASE_S)
    assert await other.take_over("s1")  # the next resume continues it at once
    store.close()
