"""The Redis log's reads: any replica's async calls to the store, each in a reader thread.

``StoreReads`` runs each call in a worker thread (``trio.to_thread.run_sync``) under a
CapacityLimiter of ``max_readers``: a follower's XREAD BLOCK holds a thread and a
connection for at most its wait. No maintained Trio-native Redis client exists; redis-py's
asyncio client would need trio-asyncio. ``StoreLeases`` (``redis_leases.py``) adds the
leases, and ``RedisEventLog`` (``redis_log.py``) the writer's side.

Cancellation: a read that changes nothing is abandoned to its thread when cancelled (the
caller returns at once; the thread gives its limiter token and its connection back when
Redis answers, within the client's socket timeout). A call whose outcome someone must
own (the take-over: a lease granted) is not abandoned: the cancel waits for Redis's
answer, the call returns it, and the caller's next checkpoint raises ``Cancelled``
(``StoreReads._call``).

Every entry a reader or a rebuild gets is checked against its HMAC (``signing.py``)
before anyone sees its bytes: one that fails raises ``StoreRejected``. ``tail`` alone
reads an entry's number and flag unchecked: they steer where a reader starts and
whether a takeover is due, and its bytes reach no client and no engine (a forged tail
makes a stream look ended or not, which deleting its keys could do as well).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
import trio

from .errors import StoreRejected
from .log import StoreUnavailable
from .redis_keys import (
    cancel_key,
    events_key,
    lua,
    reader_key,
    spec_key,
    stream_keys,
    writer_key,
)
from .signing import StoreSigner

Entry = tuple[int, bytes, bool]  # (n, data, last)


def entry_fields(signer: StoreSigner, stream_id: str, n: int, data: bytes,
                 last: bool) -> dict[str, bytes]:
    """The fields of event ``n``'s entry: its bytes, its flag, its HMAC."""
    return {"d": data, "e": b"1" if last else b"0",
            "m": signer.event_mac(stream_id, n, data, last)}


def unchecked(entry: Any) -> Entry:
    """(n, data, last) of one XRANGE/XREAD entry ``(b"0-<n>", {b"d": ..., b"e": ...})``."""
    entry_id, fields = entry
    return int(entry_id.split(b"-")[1]), fields[b"d"], fields[b"e"] == b"1"


def checked(signer: StoreSigner, stream_id: str, entry: Any) -> Entry:
    """``unchecked``, once its HMAC matched (else ``StoreRejected``)."""
    n, data, last = unchecked(entry)
    signer.check_event(stream_id, n, data, last, entry[1].get(b"m"))
    return n, data, last


def read_after(client: redis.Redis, signer: StoreSigner, stream_id: str, after: int,
               wait_ms: int) -> list[Entry] | None:
    """The replay (XRANGE) after ``after``, else a block (XREAD) for the next; None if
    the stream's events are gone. The entries checked, up to the first that fails
    (``StoreRejected`` if that is the first)."""
    key = events_key(stream_id)
    entries: Any = client.xrange(key, f"(0-{after}", "+")
    if not entries:
        if not client.exists(key):
            return None
        answer: Any = client.xread({key: f"0-{after}"}, block=wait_ms)
        if isinstance(answer, dict):  # RESP3: {key: [entries]}
            entries = next(iter(answer.values()), [])
        else:  # RESP2: [[key, [entries]]]
            entries = answer[0][1] if answer else []
    good: list[Entry] = []
    for entry in entries:
        try:
            good.append(checked(signer, stream_id, entry))
        except StoreRejected:
            if not good:
                raise
            break  # those before it first; the next read starts at it, and raises
    return good


def read_for_rebuild(client: redis.Redis, signer: StoreSigner,
                     stream_id: str) -> tuple[bytes, list[Entry]] | None:
    """(the spec, every event), each checked; None if either is gone."""
    stored: Any = client.get(spec_key(stream_id))
    entries: Any = client.xrange(events_key(stream_id), "-", "+")
    if stored is None or not entries:
        return None
    return (signer.open_spec(stream_id, stored),
            [checked(signer, stream_id, e) for e in entries])


def renew_and_look(client: redis.Redis, renew: Any, token: str, writing: list[str],
                   held: list[str], lease_ms: int) -> tuple[list[bool], list[bool]]:
    """One pipeline: the compare-and-renew of each writer lease in ``writing``, and
    whether each stream in ``held`` has a cancel mark (a DELETE on another replica)."""
    pipe = client.pipeline(transaction=False)
    for stream_id in writing:
        renew(keys=[writer_key(stream_id)], args=[token, lease_ms], client=pipe)
    for stream_id in held:
        pipe.exists(cancel_key(stream_id))
    results = pipe.execute()
    return ([bool(r) for r in results[:len(writing)]],
            [bool(r) for r in results[len(writing):]])


class StoreReads:
    """The reads of ``SharedEventLog`` that need no writer state (module docstring).

    Args:
        client: a redis-py client (``decode_responses=False``).
        signer: checks what is read (``signing.py``).
        ttl_s: the keys' time to live (a cancel mark's, for a dead writer's stream).
        max_readers: reader threads at most (the client's pool needs one more).

    Raises (every call): ``StoreUnavailable``: Redis did not answer, or refused the
    command (counted in ``_read_errors``).
    """

    def __init__(self, client: redis.Redis, signer: StoreSigner, *, ttl_s: float,
                 max_readers: int) -> None:
        self._client = client
        self._signer = signer
        self.ttl_s = ttl_s
        self._read_limiter = trio.CapacityLimiter(max_readers)
        self._read_errors = 0
        self._pinger = StorePing(client)  # /ready never waits behind the readers
        self._cancel = client.register_script(lua("cancel"))

    async def tail(self, stream_id: str) -> tuple[int, bool] | None:
        """``SharedEventLog.tail`` (unchecked: see the module docstring).

        Cancellation: abandoned: a read changes nothing, so its thread runs on unowned,
        and gives its connection back when Redis answers (the socket timeout bounds it).
        """
        entries = await self._read(self._client.xrevrange, events_key(stream_id), "+", "-",
                                   count=1)
        if not entries:
            return None
        n, _, last = unchecked(entries[0])
        return n, last

    async def ping(self) -> None:
        """``SharedEventLog.ping``, on a connection and a thread of its own
        (``StorePing``). Cancellation: abandoned: nothing changes."""
        await self._pinger.ping()

    async def read_remote(self, stream_id: str, after: int, *,
                          wait_s: float) -> list[Entry] | None:
        """``SharedEventLog.read_remote``, each event checked (``read_after``).

        Cancellation: abandoned (a read): nothing changes; its thread and connection
        stay taken until the XREAD BLOCK ends (``wait_s`` at most).
        """
        return await self._read(read_after, self._client, self._signer, stream_id, after,
                                self._ms(wait_s))

    async def reader_held(self, stream_id: str) -> bool:
        """``SharedEventLog.reader_held``. Cancellation: abandoned (a read): nothing
        changes."""
        return bool(await self._read(self._client.exists, reader_key(stream_id)))

    async def writer_alive(self, stream_id: str) -> bool:
        """``SharedEventLog.writer_alive``. Cancellation: abandoned (a read): nothing
        changes."""
        return bool(await self._read(self._client.exists, writer_key(stream_id)))

    async def read_for_rebuild(self, stream_id: str) -> tuple[bytes, list[Entry]] | None:
        """``SharedEventLog.read_for_rebuild``, each part checked.

        Cancellation: abandoned (a read): nothing changes (a failover that called it
        lets its writer lease go, ``failover.py``).
        """
        return await self._read(read_for_rebuild, self._client, self._signer, stream_id)

    async def cancel_remote(self, stream_id: str) -> bool:
        """``SharedEventLog.cancel_remote`` (``cancel.lua``).

        Cancellation: abandoned; the mark may still land (the script is one atomic step
        in Redis, run or not), and the caller does not learn which: a DELETE tried again
        is idempotent.
        """
        return bool(await self._read(self._cancel, keys=stream_keys(stream_id),
                                     args=[self._ms(self.ttl_s)]))

    async def _read(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call`` in a reader thread (``_call``). Cancellation: abandoned."""
        return await self._call(partial(call, *args, **kwargs), abandon=True)

    async def _call(self, call: Callable[[], Any], *, abandon: bool) -> Any:
        """``call`` in a reader thread, once a token of the readers' limiter is free.

        Raises:
            StoreUnavailable: Redis did not answer, or refused the command (counted).
            StoreRejected: what it read fails its check.

        Cancellation: nothing to undo while it waits for a token. Once the thread runs,
        with ``abandon`` it is abandoned: the call raises ``Cancelled`` at once and the
        thread gives its token and connection back when Redis answers (for a call that
        changes nothing a caller must own); else it is finished first: the cancel waits
        for Redis's answer (the client's socket timeout bounds it), the call returns it,
        and the caller's next checkpoint raises.
        """
        try:
            return await trio.to_thread.run_sync(call, limiter=self._read_limiter,
                                                 abandon_on_cancel=abandon)
        except redis.RedisError as exc:
            self._read_errors += 1
            raise StoreUnavailable(f"Redis: {exc!r}") from exc

    @staticmethod
    def _ms(seconds: float) -> int:
        return max(1, math.ceil(seconds * 1000))


class StorePing:
    """Pings the Redis of ``client`` on a connection of its own: ``/ready``'s question
    never waits behind the readers' limiter and pool (a follower's XREAD BLOCK holds both
    for up to ``follow_wait_s``, and a balancer would take a busy replica out).

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
