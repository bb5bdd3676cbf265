"""The resumable-stream log in Redis, shared by replicas (``STREAMSCOPE_RESUME_STORE``).

Layout: ``redis_keys.py`` (a Redis stream of events per resumable stream, its leases, its
spec). A reader's lease is a token with PX ``lease_s``: a new reader takes it over (a
plain SET of its token), and the old one finds at its next renewal (a compare-and-renew)
that it is not its own any more.

Failover: the stream's spec (what a rebuild needs; time to live ``ttl_s``, refreshed with
the events) and its writer lease (the token of the replica whose engine generates it,
PX ``writer_lease_s``), both queued by ``publish`` before the first event, so a stream in
the store always has both. ``run`` renews the writer leases (compare-and-renew, after a
flush, so never before their SET) every ``refresh_s``, a third of the shortest of the
three times, so a lease survives two missed renewals; at the stream's last event the
writer lease gets the events' time to live instead, refreshed with them, and ``expire``
deletes a stream's keys only while the writer lease is this replica's (or gone): a
writer that stalled, was taken over, and finished before a renewal could tell it leaves
the new writer's log alone. A renewal that fails (this replica stalled past its lease and
another took the stream over) tells ``on_lost``, and the registry stops the stream here
and ``disown``s it: local copy only, the store's keys are the new writer's.
``take_over`` is one Lua script: the lease is SET (PX) only if it is absent, the spec is
there and the last event does not end the stream; of replicas racing, exactly one wins.

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

Reads: through ``trio.to_thread.run_sync`` with a CapacityLimiter of ``max_readers`` (a
follower's XREAD BLOCK holds a thread and a connection for at most ``follow_wait_s``; a
cancelled read is abandoned and gives both back when Redis answers); ``ping`` has its
own (``redis_ping.py``). No maintained
Trio-native Redis client exists; redis-py's asyncio client would need trio-asyncio.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import secrets
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
import trio

from . import redis_reads
from .errors import StoreFull
from .log import MemoryEventLog, StoreStatistics, StoreUnavailable
from .redis_keys import events_key, lua, reader_key, spec_key, stream_keys, writer_key
from .redis_ping import StorePing
from .redis_writer import RedisBatchWriter
from .signing import StoreSigner

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 65_536  # queued commands; the app passes STREAMSCOPE_RESUME_STORE_QUEUE
STORE_FULL = ("the shared resume store (STREAMSCOPE_RESUME_STORE) does not keep up: its "
              "queue is full, and this stream cannot be kept in it")


class RedisEventLog:
    """``SharedEventLog`` in Redis Streams (see the module docstring).

    Args:
        client: a redis-py client (``decode_responses=False``); its pool needs
            ``max_readers + 1`` connections.
        secret: the key the replicas share: what one writes, the others can check
            (``signing.py``; at least 32 characters).
        ttl_s: how long a stream's keys live after its writer last touched them.
        lease_s: a reader's lease.
        follow_wait_s: one XREAD BLOCK at most (a follower renews its lease between).
        writer_lease_s: the lease of the replica generating a stream (failover).
        max_pending: the most commands queued for Redis (``redis_writer.py``).
    """

    def __init__(
        self, client: redis.Redis, *, secret: str | bytes, ttl_s: float, lease_s: float = 5.0,
        follow_wait_s: float = 1.0, max_readers: int = 16, writer_lease_s: float = 3.0,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        if not (0 < ttl_s < math.inf and 0 < follow_wait_s < lease_s < math.inf
                and 0 < writer_lease_s < math.inf):
            raise ValueError("need 0 < ttl_s < inf, 0 < follow_wait_s < lease_s < inf "
                             "and 0 < writer_lease_s < inf")
        self.lease_s = lease_s
        self.ttl_s = ttl_s
        self.follow_wait_s = follow_wait_s
        self.writer_lease_s = writer_lease_s
        # A third of the shortest: a lease outlives two missed renewals (a long step, a
        # Redis blip of up to RETRY_PAUSE_S) before anyone takes it for dead.
        self.refresh_s = min(ttl_s, lease_s, writer_lease_s) / 3
        self.writer_token = secrets.token_hex(8)  # this replica, as a stream's writer
        self._writing: set[str] = set()  # streams it generates: their writer lease is renewed
        # Told (sync) of a stream whose writer lease another replica took (see run), and
        # of one a DELETE on another replica cancelled.
        self.on_lost: Callable[[str], None] | None = None
        self.on_cancelled: Callable[[str], None] | None = None
        self._client = client
        self._signer = StoreSigner(secret)
        self._local = MemoryEventLog()
        self._last: dict[str, bool] = {}  # stream id -> its last event is logged
        self._local_leases: dict[str, str] = {}  # stream id -> token of a reader here
        self._cut: dict[str, bool] = {}  # streams the store takes no more of -> told
        self._writer = RedisBatchWriter(client, ttl_ms=self._ms(ttl_s), max_pending=max_pending)
        self._cut_streams = self._read_errors = 0
        self._read_limiter = trio.CapacityLimiter(max_readers)
        self._pinger = StorePing(client)  # /ready never waits behind the readers
        self._renew = client.register_script(lua("renew"))
        self._renew_longer = client.register_script(lua("renew_longer"))
        self._release = client.register_script(lua("release"))
        self._take_over = client.register_script(lua("take_over"))
        self._expire = client.register_script(lua("expire"))
        self._cancel = client.register_script(lua("cancel"))

    @classmethod
    def from_url(cls, url: str, *, secret: str | bytes, ttl_s: float, max_readers: int = 16,
                 **options: Any) -> RedisEventLog:
        """A log on a new client for ``redis://host:port/db`` (its own bounded pool)."""
        follow_wait_s = options.get("follow_wait_s", 1.0)
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_readers + 2, timeout=10.0,
            socket_timeout=follow_wait_s + 10.0, socket_connect_timeout=5.0,
        )
        return cls(redis.Redis(connection_pool=pool), secret=secret, ttl_s=ttl_s,
                   max_readers=max_readers, **options)

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
        self._local_leases.pop(stream_id, None)
        self._writing.discard(stream_id)
        self._cut.pop(stream_id, None)

    # -- the writer task ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the queue in order until cancelled; refresh held streams' time to live.

        Cancellation: as ``flush``'s; the log then writes nothing more.
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
                await self._renew_and_look()

    async def flush(self) -> None:
        """Write everything queued now, in order (``RedisBatchWriter.flush``)."""
        await self._writer.flush()

    async def stored(self) -> None:
        """Return once every command queued before the call is in Redis
        (``RedisBatchWriter.stored``: ``StoreUnavailable`` if the writer stopped)."""
        await self._writer.stored()

    async def _renew_and_look(self) -> None:
        """Renew (compare-and-renew) the writer lease of each stream this replica
        generates, after a flush (so never before its SET), and look for cancel marks
        on each it holds: one whose lease another replica took (this one stalled past
        it) is let go (``on_lost``; nothing of it is touched in the store again), one
        marked is cancelled (``on_cancelled``; ``expire`` then deletes its keys).
        Without an answer from the store, nothing changes. Cancellation: the same."""
        writing, held = list(self._writing), list(self._last)
        if not (writing or held) or self._writer.stopped:
            return
        try:
            renewed, marked = await self._read(
                redis_reads.renew_and_look, self._client, self._renew_longer,
                self.writer_token, writing, held, self._ms(self.writer_lease_s))
        except StoreUnavailable:
            return
        for stream_id, still in zip(writing, renewed, strict=True):
            if not still and stream_id in self._writing:
                self._writing.discard(stream_id)
                log.warning("resume log: another replica took stream %s over", stream_id)
                if self.on_lost is not None:
                    self.on_lost(stream_id)
        for stream_id, cancelled in zip(held, marked, strict=True):
            if cancelled and stream_id in self._last and self.on_cancelled is not None:
                self.on_cancelled(stream_id)

    def _queue_refresh(self) -> None:
        """The held streams' time to live (an ended one's writer lease too), and the
        leases of this replica's readers."""
        keys = [k for s in self._last for k in (events_key(s), spec_key(s))]
        ended = [s for s, last in self._last.items() if last]
        ttl_ms = self._ms(self.ttl_s)
        leases, lease_ms = list(self._local_leases.items()), self._ms(self.lease_s)

        def op(pipe: Any) -> None:
            for key in keys:
                pipe.pexpire(key, ttl_ms)
            for stream_id in ended:
                self._keep_writer_lease(stream_id, ttl_ms, pipe)
            for stream_id, token in leases:
                self._renew(keys=[reader_key(stream_id)], args=[token, lease_ms], client=pipe)

        if keys or leases:
            self._writer.queue(op)

    def _keep_writer_lease(self, stream_id: str, ttl_ms: int, pipe: Any) -> None:
        """An ended stream's writer lease lives as long as its events, if it is still
        this replica's (compare-and-renew): so ``expire`` can tell whose keys they are."""
        self._renew(keys=[writer_key(stream_id)], args=[self.writer_token, ttl_ms],
                    client=pipe)

    # -- SharedEventLog: any replica's readers, async --------------------------------

    async def tail(self, stream_id: str) -> tuple[int, bool] | None:
        entries = await self._read(self._client.xrevrange, events_key(stream_id), "+", "-",
                                   count=1)
        if not entries:
            return None
        n, _, last = redis_reads.unchecked(entries[0])
        return n, last

    async def ping(self) -> None:
        await self._pinger.ping()

    async def read_remote(
        self, stream_id: str, after: int, *, wait_s: float
    ) -> list[tuple[int, bytes, bool]] | None:
        """``SharedEventLog.read_remote``, each event checked (``redis_reads``)."""
        return await self._read(redis_reads.read_after, self._client, self._signer,
                                stream_id, after, self._ms(wait_s))

    async def claim_reader(self, stream_id: str, token: str) -> None:
        await self._read(self._client.set, reader_key(stream_id), token,
                         px=self._ms(self.lease_s))

    async def renew_reader(self, stream_id: str, token: str) -> bool:
        if self._writer.is_setting(stream_id, token):
            await trio.lowlevel.checkpoint()
            return True  # its SET is on its way
        return bool(await self._read(self._renew, keys=[reader_key(stream_id)],
                                     args=[token, self._ms(self.lease_s)]))

    def hold_local_reader(self, stream_id: str, token: str, *, claimed: bool) -> None:
        key, lease_ms = reader_key(stream_id), self._ms(self.lease_s)
        self._local_leases[stream_id] = token
        if not claimed and self._writer.queue(  # a new stream: nobody else knows its id yet
                lambda pipe: pipe.set(key, token, px=lease_ms)):
            self._writer.setting(stream_id, token)

    def release_local_reader(self, stream_id: str) -> None:
        token = self._local_leases.pop(stream_id, None)
        if token is not None:
            self.release_reader(stream_id, token)

    def release_reader(self, stream_id: str, token: str) -> None:
        key = reader_key(stream_id)
        self._writer.queue(lambda pipe: self._release(keys=[key], args=[token], client=pipe))

    async def reader_held(self, stream_id: str) -> bool:
        return bool(await self._read(self._client.exists, reader_key(stream_id)))

    # -- failover: a stream whose writer died ---------------------------------------

    async def writer_alive(self, stream_id: str) -> bool:
        return bool(await self._read(self._client.exists, writer_key(stream_id)))

    async def take_over(self, stream_id: str) -> bool:
        lease_ms = self._ms(self.writer_lease_s)
        won = bool(await self._read(self._take_over, keys=stream_keys(stream_id),
                                    args=[self.writer_token, lease_ms]))
        if won:
            self._writing.add(stream_id)  # renewed from now on
        return won

    async def read_for_rebuild(
        self, stream_id: str
    ) -> tuple[bytes, list[tuple[int, bytes, bool]]] | None:
        """``SharedEventLog.read_for_rebuild``, each part checked (``redis_reads``)."""
        return await self._read(redis_reads.read_for_rebuild, self._client, self._signer,
                                stream_id)

    async def cancel_remote(self, stream_id: str) -> bool:
        """``SharedEventLog.cancel_remote`` (``cancel.lua``)."""
        return bool(await self._read(self._cancel, keys=stream_keys(stream_id),
                                     args=[self._ms(self.ttl_s)]))

    def adopt(self, stream_id: str, events: list[tuple[int, bytes, bool]]) -> None:
        self._cut.pop(stream_id, None)
        self._local.expire(stream_id)
        for n, data, _ in events:
            self._local.append(stream_id, n, data)
        self._last[stream_id] = False

    def disown(self, stream_id: str) -> int:
        self._forget(stream_id)
        return self._local.expire(stream_id)  # the store's keys are the new writer's

    def release_writer(self, stream_id: str) -> None:
        self._writing.discard(stream_id)
        key, token = writer_key(stream_id), self.writer_token
        self._writer.queue(lambda pipe: self._release(keys=[key], args=[token], client=pipe))

    async def _read(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call`` in a reader thread; abandoned if cancelled (the thread gives its
        limiter token and connection back when Redis answers).

        Raises:
            StoreUnavailable: Redis did not answer, or refused the command (counted).
            StoreRejected: what it read fails its check (``redis_reads``).
        """
        try:
            return await trio.to_thread.run_sync(partial(call, *args, **kwargs),
                                                 limiter=self._read_limiter,
                                                 abandon_on_cancel=True)
        except redis.RedisError as exc:
            self._read_errors += 1
            raise StoreUnavailable(f"Redis: {exc!r}") from exc

    @staticmethod
    def _ms(seconds: float) -> int:
        return max(1, math.ceil(seconds * 1000))

