"""The resumable-stream log in Redis, shared by replicas (``STREAMSCOPE_RESUME_STORE``).

Layout (``redis_keys.py``): one Redis stream per resumable stream, entry id ``0-<n>``
(the event's number: XADD with an explicit id refuses an id at or below the last, so the
store itself never holds a duplicate or an out-of-order event), fields ``d`` (the encoded
SSE event) and ``e`` (``1`` on the stream's last event). A reader's lease is a token
with PX ``lease_s``: a new reader takes it over (a plain SET of its token), and the old
one finds at its next renewal (a compare-and-renew) that it is not its own any more.

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

Why Redis Streams and not lists: XRANGE from an id replays exactly the events after a
position (a list would need the index arithmetic, and nothing refuses a duplicate), and
XREAD BLOCK from that id follows new events with no lost wake-up (an entry appended
between the replay and the block is returned at once); pub/sub would need a second
connection per follower and loses what is published while it is not subscribed.

Writes: ``append`` and ``expire`` are sync and never a checkpoint. They change a local
``MemoryEventLog`` (the writer replays its own streams from memory) and queue the Redis
commands on the ``RedisBatchWriter`` (``redis_writer.py``), which ``run`` flushes. Every
``refresh_s`` the keys of the streams this replica holds get their time to live back
(``ttl_s``): a stream outlives its writer's death by at most ``ttl_s``; the writer deletes
a stream's keys when it forgets it.

Reads: through ``trio.to_thread.run_sync`` with a CapacityLimiter of ``max_readers`` (a
follower's XREAD BLOCK holds a thread and a connection for at most ``follow_wait_s``; a
cancelled read is abandoned and gives both back when Redis answers). No maintained
Trio-native Redis client exists; redis-py's asyncio client would need trio-asyncio.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
import trio

from .log import MemoryEventLog, StoreStatistics, StoreUnavailable
from .redis_keys import events_key, lua, reader_key, spec_key, writer_key
from .redis_writer import RedisBatchWriter

log = logging.getLogger(__name__)


class RedisEventLog:
    """``SharedEventLog`` in Redis Streams (see the module docstring).

    Args:
        client: a redis-py client (``decode_responses=False``); its pool needs
            ``max_readers + 1`` connections.
        ttl_s: how long a stream's keys live after its writer last touched them.
        lease_s: a reader's lease.
        follow_wait_s: one XREAD BLOCK at most (a follower renews its lease between).
        writer_lease_s: the lease of the replica generating a stream (failover).
    """

    def __init__(
        self, client: redis.Redis, *, ttl_s: float, lease_s: float = 5.0,
        follow_wait_s: float = 1.0, max_readers: int = 16, writer_lease_s: float = 3.0,
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
        # Told (sync) of a stream whose writer lease another replica took (see run).
        self.on_lost: Callable[[str], None] | None = None
        self._client = client
        self._local = MemoryEventLog()
        self._last: dict[str, bool] = {}  # stream id -> its last event is logged
        self._local_leases: dict[str, str] = {}  # stream id -> token of a reader here
        self._writer = RedisBatchWriter(client, ttl_ms=self._ms(ttl_s))
        self._read_limiter = trio.CapacityLimiter(max_readers)
        self._renew = client.register_script(lua("renew"))
        self._renew_longer = client.register_script(lua("renew_longer"))
        self._release = client.register_script(lua("release"))
        self._take_over = client.register_script(lua("take_over"))
        self._expire = client.register_script(lua("expire"))

    @classmethod
    def from_url(cls, url: str, *, ttl_s: float, max_readers: int = 16,
                 **options: Any) -> RedisEventLog:
        """A log on a new client for ``redis://host:port/db`` (its own bounded pool)."""
        follow_wait_s = options.get("follow_wait_s", 1.0)
        pool = redis.BlockingConnectionPool.from_url(
            url, max_connections=max_readers + 2, timeout=10.0,
            socket_timeout=follow_wait_s + 10.0, socket_connect_timeout=5.0,
        )
        return cls(redis.Redis(connection_pool=pool), ttl_s=ttl_s,
                   max_readers=max_readers, **options)

    # -- EventLog: the writer's side, sync, never a checkpoint -----------------------

    def publish(self, stream_id: str, spec: bytes) -> None:
        """A new stream this replica generates: its rebuild spec (what another replica
        needs to continue it) and this replica's writer lease, queued before its first
        event, so that a stream in the store always has both. Sync, no checkpoint."""
        keys, token = (spec_key(stream_id), writer_key(stream_id)), self.writer_token
        ttl_ms, lease_ms = self._ms(self.ttl_s), self._ms(self.writer_lease_s)
        self._writing.add(stream_id)

        def op(pipe: Any) -> None:
            pipe.set(keys[0], spec, px=ttl_ms)
            pipe.set(keys[1], token, px=lease_ms)

        self._writer.queue(op)

    def append(self, stream_id: str, n: int, data: bytes, *, last: bool = False) -> None:
        self._local.append(stream_id, n, data)  # raises on a gap or a duplicate
        self._last[stream_id] = last
        key = events_key(stream_id)
        fields = {"d": data, "e": b"1" if last else b"0"}
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
        self._last.pop(stream_id, None)
        self._local_leases.pop(stream_id, None)
        self._writing.discard(stream_id)
        keys = [writer_key(stream_id), events_key(stream_id), reader_key(stream_id),
                spec_key(stream_id)]
        token = self.writer_token
        self._writer.queue(lambda pipe: self._expire(keys=keys, args=[token], client=pipe))
        return self._local.expire(stream_id)

    @property
    def total_bytes(self) -> int:
        return self._local.total_bytes

    def statistics(self) -> StoreStatistics:
        return self._writer.statistics()

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
                await self._renew_writer_leases()

    async def flush(self) -> None:
        """Write everything queued now, in order (``RedisBatchWriter.flush``)."""
        await self._writer.flush()

    async def stored(self) -> None:
        """Return once every command queued before the call is in Redis
        (``RedisBatchWriter.stored``: ``StoreUnavailable`` if the writer stopped)."""
        await self._writer.stored()

    async def _renew_writer_leases(self) -> None:
        """Renew the writer lease of every stream this replica generates (compare-and-
        renew); one whose lease another replica took (this one stalled past it) is let
        go: ``on_lost`` is told, and nothing of it is touched in the store again.

        Runs after a flush, which wrote every queued ``publish``: no lease is renewed
        before it was set. Without an answer from the store, nothing changes.
        Cancellation: as ``_read``'s; nothing changes.
        """
        writing = list(self._writing)
        if not writing or self._writer.stopped:
            return
        try:
            held = await self._read(self._renew_leases, writing, self._ms(self.writer_lease_s))
        except StoreUnavailable:
            return
        for stream_id, still in zip(writing, held, strict=True):
            if not still and stream_id in self._writing:
                self._writing.discard(stream_id)
                log.warning("resume log: another replica took stream %s over", stream_id)
                if self.on_lost is not None:
                    self.on_lost(stream_id)

    def _renew_leases(self, writing: list[str], lease_ms: int) -> list[bool]:
        """In a reader thread: one pipeline of compare-and-renews."""
        pipe = self._client.pipeline(transaction=False)
        for stream_id in writing:
            self._renew_longer(keys=[writer_key(stream_id)],
                               args=[self.writer_token, lease_ms], client=pipe)
        return [bool(result) for result in pipe.execute()]

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
        n, _, last = _entry(entries[0])
        return n, last

    async def ping(self) -> None:
        await self._read(self._client.ping)

    async def read_remote(
        self, stream_id: str, after: int, *, wait_s: float
    ) -> list[tuple[int, bytes, bool]] | None:
        return await self._read(self._read_blocking, events_key(stream_id), after, wait_s)

    def _read_blocking(
        self, key: str, after: int, wait_s: float
    ) -> list[tuple[int, bytes, bool]] | None:
        """In a worker thread: the replay (XRANGE), else a block for the next (XREAD)."""
        entries: Any = self._client.xrange(key, f"(0-{after}", "+")
        if not entries:
            if not self._client.exists(key):
                return None
            answer: Any = self._client.xread({key: f"0-{after}"}, block=self._ms(wait_s))
            if isinstance(answer, dict):  # RESP3: {key: [entries]}
                entries = next(iter(answer.values()), [])
            else:  # RESP2: [[key, [entries]]]
                entries = answer[0][1] if answer else []
        return [_entry(e) for e in entries]

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
        if not claimed:  # a new stream: nobody else knows its id yet
            self._writer.setting(stream_id, token)
            self._writer.queue(lambda pipe: pipe.set(key, token, px=lease_ms))

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
        won = bool(await self._read(self._take_over, keys=[
            writer_key(stream_id), events_key(stream_id), spec_key(stream_id)],
            args=[self.writer_token, lease_ms]))
        if won:
            self._writing.add(stream_id)  # renewed from now on
        return won

    async def read_for_rebuild(
        self, stream_id: str
    ) -> tuple[bytes, list[tuple[int, bytes, bool]]] | None:
        def read() -> tuple[bytes, list[tuple[int, bytes, bool]]] | None:
            spec: Any = self._client.get(spec_key(stream_id))
            entries: Any = self._client.xrange(events_key(stream_id), "-", "+")
            return None if spec is None or not entries else (spec, [_entry(e) for e in entries])

        return await self._read(read)

    def adopt(self, stream_id: str, events: list[tuple[int, bytes, bool]]) -> None:
        self._local.expire(stream_id)
        for n, data, _ in events:
            self._local.append(stream_id, n, data)
        self._last[stream_id] = False

    def disown(self, stream_id: str) -> int:
        self._last.pop(stream_id, None)
        self._local_leases.pop(stream_id, None)
        self._writing.discard(stream_id)
        return self._local.expire(stream_id)  # the store's keys are the new writer's

    def release_writer(self, stream_id: str) -> None:
        self._writing.discard(stream_id)
        key, token = writer_key(stream_id), self.writer_token
        self._writer.queue(lambda pipe: self._release(keys=[key], args=[token], client=pipe))

    async def _read(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call`` in a reader thread; abandoned if cancelled (the thread gives its
        limiter token and connection back when Redis answers).

        Raises:
            StoreUnavailable: Redis did not answer, or refused the command.
        """
        try:
            return await trio.to_thread.run_sync(partial(call, *args, **kwargs),
                                                 limiter=self._read_limiter,
                                                 abandon_on_cancel=True)
        except redis.RedisError as exc:
            raise StoreUnavailable(f"Redis: {exc!r}") from exc

    @staticmethod
    def _ms(seconds: float) -> int:
        return max(1, math.ceil(seconds * 1000))


def _entry(entry: Any) -> tuple[int, bytes, bool]:
    """(n, data, last) of one XRANGE/XREAD entry ``(b"0-<n>", {b"d": ..., b"e": ...})``."""
    entry_id, fields = entry
    return int(entry_id.split(b"-")[1]), fields[b"d"], fields[b"e"] == b"1"
