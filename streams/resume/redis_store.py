"""A replica's one connection to the shared Redis (``STREAMSCOPE_RESUME_STORE``): one
redis-py client on one bounded pool, and the one signer of what the replicas keep there.

Why one: the resume log (``redis_log.py``) and the other stores a replica keeps in the
same Redis (the Responses API's stored responses, ``app.runtime.responses_store``) talk
to one server with one secret. One client means one pool to size and one set of socket
timeouts; one signer means one scheme for what a replica trusts (``signing.py``): a value
another replica wrote is checked the same way whatever it is.

The pool's connections: the log's ``max_readers`` reader threads, its writer, one spare
(as ``RedisEventLog.from_url`` has always had), and ``other_calls`` for everyone else,
whose calls run here (``call``) under a limiter of that many threads, so they never wait
for a connection the readers hold, and the readers never wait behind them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import redis
import trio

from .log import StoreUnavailable
from .signing import StoreSigner

OTHER_CALLS = 4  # the pool's connections (and threads) for calls other than the log's
POOL_WAIT_S = 10.0  # a call waits this long for a free connection of the pool at most


class RedisStore:
    """One client and one signer, shared by every user of the shared Redis (see the
    module docstring).

    Args:
        client: a redis-py client (``decode_responses=False``) whose pool has
            ``max_readers + 2 + other_calls`` connections (``from_url`` makes one).
        signer: signs and checks what the replicas store (``signing.py``).
        max_readers: the resume log's reader threads.
        follow_wait_s: the resume log's longest XREAD BLOCK (the pool's socket timeout
            is longer).
        other_calls: threads (and connections) for ``call``.
    """

    def __init__(self, client: redis.Redis, signer: StoreSigner, *, max_readers: int = 16,
                 follow_wait_s: float = 1.0, other_calls: int = OTHER_CALLS) -> None:
        self.client = client
        self.signer = signer
        self.max_readers = max_readers
        self.follow_wait_s = follow_wait_s
        self._other_calls = trio.CapacityLimiter(other_calls) if other_calls else None

    @classmethod
    def from_url(cls, url: str, *, secret: str | bytes, max_readers: int = 16,
                 follow_wait_s: float = 1.0, other_calls: int = OTHER_CALLS) -> RedisStore:
        """A store on a new client for ``redis://host:port/db``: its own bounded pool (a
        connection is made when first needed: this makes none), its signer of
        ``secret`` (at least 32 characters, else ``ValueError``)."""
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_readers + 2 + other_calls, timeout=POOL_WAIT_S,
            socket_timeout=follow_wait_s + 10.0, socket_connect_timeout=5.0,
        )
        return cls(redis.Redis(connection_pool=pool), StoreSigner(secret),
                   max_readers=max_readers, follow_wait_s=follow_wait_s,
                   other_calls=other_calls)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (a call on ``client``, or a script of it) in a worker
        thread, once one of the ``other_calls`` is free.

        Raises:
            StoreUnavailable: Redis did not answer, or refused the command.
            RuntimeError: the store was made with no ``other_calls``.

        Cancellation: while it waits for a thread, nothing has happened; once the thread
        runs, it is abandoned: the call raises ``Cancelled`` at once, and what it asked
        lands or not (the thread gives its connection back when Redis answers, within
        the pool's socket timeout).
        """
        if self._other_calls is None:
            raise RuntimeError("this Redis store keeps no connections for other calls")
        try:
            return await trio.to_thread.run_sync(partial(fn, *args, **kwargs),
                                                 limiter=self._other_calls,
                                                 abandon_on_cancel=True)
        except (redis.RedisError, OSError) as exc:
            raise StoreUnavailable(f"Redis: {exc!r}") from exc
