"""The resumable-stream log in Redis, shared by replicas (``STREAMSCOPE_RESUME_STORE``).

Layout: ``redis_keys.py`` (a Redis stream of events per resumable stream, its leases, its
spec). The leases (a stream's one reader, the replica that generates it, the takeover)
are ``redis_leases.py``'s: ``StoreLeases``, which this log extends.

Failover: the stream's spec (what a rebuild needs; time to live ``ttl_s``, refreshed with
the events) and its writer lease, both queued by ``publish`` before the first event, so a
stream in the store always has both. ``run`` renews the writer leases every
``refresh_s``, a third of the shortest of the three times, so a lease survives two missed
renewals; ``expire`` deletes a stream's keys only while the writer lease is this
replica's (or gone): a writer that stalled, was taken over, and finished before a renewal
could tell it leaves the new writer's log alone. A stream another replica took over is
``disown``ed: local copy only, the store's keys are the new writer's.

Writes: ``append`` and ``expire`` are sync and never a checkpoint. They change a local
``MemoryEventLog`` (the writer replays its own streams from memory) and queue the Redis
commands on the ``RedisBatchWriter`` (``redis_writer.py``: bounded, one transaction a
batch), which ``run`` flushes. Every ``refresh_s`` the keys of the streams this replica
holds get their time to live back (``ttl_s``): a stream outlives its writer's death by at
most ``ttl_s``; the writer deletes a stream's keys when it forgets it. A stream whose
event finds the queue full is cut from the store: that ``append`` raises ``StoreFull``
(the registry ends the stream with an error event), and what it logs from then on goes
to the local copy only. Everything written is signed and every read checked
(``signing.py``, ``redis_reads.py``): the replicas share ``secret``.

Cancel from another replica: ``cancel_remote`` leaves a cancel mark (``cancel.lua``),
which the writer finds at its next renewal (every ``refresh_s``) and tells ``on_cancelled``.

Reads: any replica's calls to the store run in reader threads (``redis_reads.StoreReads``,
which this log extends through ``StoreLeases``). What a cancel does: a read is abandoned
(nothing changes); the take-over is not (``redis_leases.py``); ``run`` cancelled writes
nothing more, and the leases it renewed lapse (``redis_writer.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from functools import partial
from typing import Any

import redis
import trio

from . import redis_reads
from .errors import StoreFull
from .log import MemoryEventLog, StoreStatistics
from .redis_keys import events_key, lua, spec_key, stream_keys, writer_key
from .redis_leases import StoreLeases
from .redis_store import RedisStore
from .redis_writer import RedisBatchWriter
from .signing import StoreSigner

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 65_536  # queued commands; the app passes STREAMSCOPE_RESUME_STORE_QUEUE
STORE_FULL = ("the shared resume store (STREAMSCOPE_RESUME_STORE) does not keep up: its "
              "queue is full, and this stream cannot be kept in it")


class RedisEventLog(StoreLeases):
    """``SharedEventLog`` in Redis Streams (see the module docstring).

    Args:
        client: a redis-py client (``decode_responses=False``); its pool needs
            ``max_readers + 1`` connections.
        secret: the key the replicas share: what one writes, the others can check
            (``signing.py``; at least 32 characters); or the signer made of it (a
            ``RedisStore``'s, which the replica's other stores in Redis share).
        ttl_s: how long a stream's keys live after its writer last touched them.
        lease_s: a reader's lease.
        follow_wait_s: one XREAD BLOCK at most (a follower renews its lease between).
        writer_lease_s: the lease of the replica generating a stream (failover).
        max_pending: the most commands queued for Redis (``redis_writer.py``).
    """

    def __init__(
        self, client: redis.Redis, *, secret: str | bytes | StoreSigner, ttl_s: float,
        lease_s: float = 5.0,
        follow_wait_s: float = 1.0, max_readers: int = 16, writer_lease_s: float = 3.0,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if not (0 < ttl_s < math.inf and 0 < follow_wait_s < lease_s < math.inf
                and 0 < writer_lease_s < math.inf):
            raise ValueError("need 0 < ttl_s < inf, 0 < follow_wait_s < lease_s < inf "
                             "and 0 < writer_lease_s < inf")
        writer = RedisBatchWriter(client, ttl_ms=self._ms(ttl_s), max_pending=max_pending)
        signer = secret if isinstance(secret, StoreSigner) else StoreSigner(secret)
        super().__init__(client, signer, writer, ttl_s=ttl_s, lease_s=lease_s,
                         writer_lease_s=writer_lease_s, max_readers=max_readers)
        self.follow_wait_s = follow_wait_s
        # A third of the shortest: a lease outlives two missed renewals (a long step, a
        # Redis blip of up to RETRY_PAUSE_S) before anyone takes it for dead.
        self.refresh_s = min(ttl_s, lease_s, writer_lease_s) / 3
        self._local = MemoryEventLog()
        self._last: dict[str, bool] = {}  # stream id -> its last event is logged
        self._cut: dict[str, bool] = {}  # streams the store takes no more of -> told
        self._cut_streams = 0
        self._expire = client.register_script(lua("expire"))

    @classmethod
    def from_url(cls, url: str, *, secret: str | bytes, ttl_s: float, max_readers: int = 16,
                 **options: Any) -> RedisEventLog:
        """A log on a new client for ``redis://host:port/db`` (its own bounded pool,
        shared with nothing else: ``RedisStore.from_url`` with no ``other_calls``)."""
        store = RedisStore.from_url(url, secret=secret, max_readers=max_readers,
                                    follow_wait_s=options.get("follow_wait_s", 1.0),
                                    other_calls=0)
        return cls.on_store(store, ttl_s=ttl_s, **options)

    @classmethod
    def on_store(cls, store: RedisStore, *, ttl_s: float, **options: Any) -> RedisEventLog:
        """A log on ``store``'s client and signer (a replica's one connection to the
        shared Redis, which its other stores there use too), with its reader threads and
        its longest block."""
        options.setdefault("follow_wait_s", store.follow_wait_s)
        if options["follow_wait_s"] > store.follow_wait_s:
            raise ValueError("the log's follow_wait_s is longer than its store's pool allows")
        return cls(store.client, secret=store.signer, ttl_s=ttl_s,
                   max_readers=store.max_readers, **options)

    # -- EventLog: the writer's side, sync, never a checkpoint -----------------------

    def publish(self, stream_id: str, spec: bytes) -> None:
        """A new stream this replica generates: its rebuild spec (what another replica
        needs to continue it) and this replica's writer lease, queued before its first
        event, so that a stream in the store always has both (signed). Sync, no
        checkpoint. With the queue full, the stream is cut (its first append raises)."""
        keys, token = (spec_key(stream_id), writer_key(stream_id)), self.writer_token
        ttl_ms, lease_ms = self._ms(self.ttl_s), self._ms(self.writer_lease_s)
        signed = self._signer.sign_spec(stream_id, spec)

        def op(pipe: Any) -> None:
            pipe.set(keys[0], signed, px=ttl_ms)
            pipe.set(keys[1], token, px=lease_ms)

        if self._writer.queue(op):
            self._writing.add(stream_id)
        else:
            self._cut_off(stream_id)

    def append(self, stream_id: str, n: int, data: bytes, *, last: bool = False) -> None:
        """``EventLog.append``; also raises ``StoreFull`` (once per stream, nothing
        logged) when the store's queue is full: the store takes no more of the stream."""
        if stream_id not in self._cut and not self._writer.has_room():
            self._cut_off(stream_id)
        if self._cut.get(stream_id) is False:
            self._cut[stream_id] = True
            raise StoreFull(STORE_FULL)
        self._local.append(stream_id, n, data)  # raises on a gap or a duplicate
        self._last[stream_id] = last
        if stream_id in self._cut:
            return  # this replica's copy only (its writer lease is kept until forgotten)
        key = events_key(stream_id)
        fields = redis_reads.entry_fields(self._signer, stream_id, n, data, last)
        self._writer.touch(key)  # its time to live is set once per batch
        self._writer.queue(lambda pipe: pipe.xadd(key, fields, id=f"0-{n}"))
        if last:  # ended: nothing left to take over; the lease lives with the events
            self._writing.discard(stream_id)
            self._writer.queue(partial(self._keep_writer_lease, stream_id,
                                       self._ms(self.ttl_s)))

    def read_after(self, stream_id: str, n: int) -> list[bytes] | None:
        return self._local.read_after(stream_id, n)

    def expire(self, stream_id: str) -> int:
        """Forget a stream: its local copy, and its keys in the store unless another
        replica writes it now (one that took it over while this one stalled, then this
        one finished it before a renewal could tell: its keys are that replica's)."""
        self._forget(stream_id)
        keys, token = stream_keys(stream_id), self.writer_token
        self._writer.queue(lambda pipe: self._expire(keys=keys, args=[token], client=pipe))
        return self._local.expire(stream_id)

    @property
    def total_bytes(self) -> int:
        return self._local.total_bytes

    def statistics(self) -> StoreStatistics:
        return dataclasses.replace(self._writer.statistics(), cut_streams=self._cut_streams,
                                   read_errors=self._read_errors)

    def _cut_off(self, stream_id: str) -> None:
        """The queue is full: the stream's next append raises ``StoreFull`` (see append)."""
        self._cut[stream_id] = False
        self._cut_streams += 1
        log.warning("resume log: the queue is full; stream %s is cut from Redis", stream_id)

    def _forget(self, stream_id: str) -> None:
        self._last.pop(stream_id, None)
        self._forget_leases(stream_id)
        self._cut.pop(stream_id, None)

    # -- the writer task ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the queue in order until cancelled; refresh held streams' time to live.

        Cancellation: the way it stops: the batch in flight is abandoned to its thread (a
        stop does not wait for a Redis that does not answer) and the log writes nothing
        more, so no later batch overtakes it; what is left expires by its time to live.
        """
        task_status.started()
        next_refresh = trio.current_time() + self.refresh_s
        while True:
            await self._writer.wait_for_work(next_refresh)
            renew = trio.current_time() >= next_refresh
            if renew:
                self._queue_refresh()
                next_refresh = trio.current_time() + self.refresh_s
            await self.flush()
            if renew:
                await self._renew_and_look(self._last)  # writer leases, cancel marks

    async def flush(self) -> None:
        """Write everything queued now, in order (``RedisBatchWriter.flush``).

        Cancellation: the batch in flight is abandoned to its thread and the log writes
        nothing more (no later batch may overtake it): what is left expires.
        """
        await self._writer.flush()

    async def stored(self) -> None:
        """Return once every command queued before the call is in Redis
        (``RedisBatchWriter.stored``: ``StoreUnavailable`` if the writer stopped).

        Cancellation: nothing to undo: it only waits for the writer, which goes on.
        """
        await self._writer.stored()

    def _queue_refresh(self) -> None:
        """The held streams' time to live (an ended one's writer lease too), and the
        leases of this replica's readers."""
        keys = [k for s in self._last for k in (events_key(s), spec_key(s))]
        ended = [s for s, last in self._last.items() if last]
        ttl_ms = self._ms(self.ttl_s)
        leases = list(self._local_leases.items())

        def op(pipe: Any) -> None:
            for key in keys:
                pipe.pexpire(key, ttl_ms)
            for stream_id in ended:
                self._keep_writer_lease(stream_id, ttl_ms, pipe)
            self._renew_readers(leases, pipe)

        if keys or leases:
            self._writer.queue(op)

    # -- failover: a stream whose writer died (its leases: ``StoreLeases``) -------------

    def adopt(self, stream_id: str, events: list[tuple[int, bytes, bool]]) -> None:
        self._cut.pop(stream_id, None)
        self._local.expire(stream_id)
        for n, data, _ in events:
            self._local.append(stream_id, n, data)
        self._last[stream_id] = False

    def disown(self, stream_id: str) -> int:
        self._forget(stream_id)
        return self._local.expire(stream_id)  # the store's keys are the new writer's
