"""``/ready``'s question to Redis, on a connection and a limiter of its own.

The log's reads go through one CapacityLimiter of ``max_readers`` threads and one pool of
connections (``redis_log.py``); a follower's XREAD BLOCK holds both for up to
``follow_wait_s``. A ping taken from that limiter waited behind busy readers, and
``/ready`` (asked with a 0.5 s budget) called a store that answers unavailable, so a
balancer took a healthy but busy replica out (issue 33). The ping has its own: a pool of
one connection to the same server, and a limiter of one thread.
"""

from __future__ import annotations

import redis
import trio

from .log import StoreUnavailable


class StorePing:
    """Pings the Redis of ``client`` on a connection of its own.

    Args:
        client: the log's client; only its pool's connection settings are used.
    """

    def __init__(self, client: redis.Redis) -> None:
        pool = client.connection_pool
        own = redis.ConnectionPool(connection_class=pool.connection_class, max_connections=1,
                                   **pool.connection_kwargs)
        self._client = redis.Redis(connection_pool=own)
        self._limiter = trio.CapacityLimiter(1)  # a ping still out (Redis hangs): wait

    async def ping(self) -> None:
        """Raises StoreUnavailable: Redis did not answer, or refused.

        Cancellation: the ping is abandoned to its thread, which gives the limiter and
        the connection back when Redis answers (or its socket times out).
        """
        try:
            await trio.to_thread.run_sync(self._client.ping, limiter=self._limiter,
                                          abandon_on_cancel=True)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"Redis: {exc!r}") from exc
