"""The resumable-stream log in Redis, shared by replicas (``STREAMSCOPE_RESUME_STORE``).

Layout: one Redis stream per resumable stream, ``streamscope:{<id>}:events``, entry id
``0-<n>`` (the event's number: XADD with an explicit id refuses an id at or below the
last, so the store itself never holds a duplicate or an out-of-order event), fields
``d`` (the encoded SSE event) and ``e`` (``1`` on the stream's last event). A reader's
lease is ``streamscope:{<id>}:reader`` (a token, PX ``lease_s``): a new reader takes it
over (a plain SET of its token), and the old one finds at its next renewal (a
compare-and-renew) that it is not its own any more. The braces keep both keys in one
Redis Cluster slot.

Failover keys: ``streamscope:{<id>}:spec`` (what a rebuild needs, from the app; time to
live ``ttl_s``, refreshed with the events) and ``streamscope:{<id>}:owner`` (the owning
replica's token, PX ``owner_lease_s``), both queued by ``publish`` before the first
event, so a stream in the store always has both. The writer task renews the owner lease
(compare-and-renew, after a flush, so never before its SET) every ``refresh_s``, a third
of the shortest of the three times, so a lease survives two missed renewals; at the
stream's last event the owner key gets the events' time to live instead, refreshed with
them, and ``expire`` deletes a stream's keys only while the owner key is this replica's
(or gone): an owner that stalled, was taken over, and finished before a renewal could tell
it leaves the new owner's log alone. A renewal that fails (this replica stalled past its lease and
another took the stream over) tells ``on_lost``, and the registry stops the stream here
and ``disown``s it: local copy only, the store's keys are the new owner's. ``take_over``
is one Lua script: the owner key is SET (PX) only if it is absent, the spec is there and
the last event does not end the stream; of replicas racing for it, exactly one gets 1.

Why Redis Streams and not lists: XRANGE from an id replays exactly the events after a
position (a list would need the index arithmetic, and nothing refuses a duplicate), and
XREAD BLOCK from that id follows new events with no lost wake-up (an entry appended
between the replay and the block is returned at once); pub/sub would need a second
connection per follower and loses what is published while it is not subscribed.

Writes: ``append`` and ``expire`` are sync and never a checkpoint (the registry logs an
item in the same step as it takes it). They change a local ``MemoryEventLog`` (the owner
replays its own streams from memory) and queue the Redis commands; ``run`` writes the
queue in order, one pipeline per batch, in a worker thread; each stream appended to in
a batch gets its time to live set once, at the batch's end. A batch that fails to reach
Redis is tried again, in order, after a pause (the explicit ids make a partly applied
batch safe to repeat). Every ``refresh_s`` the keys of the streams this replica holds
get their time to live back (``ttl_s``): a stream outlives its owner's death by at most
``ttl_s``; the owner deletes a stream's keys when it forgets it.

Threads: redis-py's sync client, called through ``trio.to_thread.run_sync`` with
a lock for the writer (one batch at a time, in order) and a CapacityLimiter of
``max_readers`` for readers (a
follower's XREAD BLOCK holds a thread and a connection for at most ``follow_wait_s``;
a cancelled read is abandoned and gives both back when Redis answers). No maintained
Trio-native Redis client exists; redis-py's asyncio client would need trio-asyncio.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import redis
import trio

from .resume_log import MemoryEventLog, StoreUnavailable

log = logging.getLogger(__name__)

KEY_PREFIX = "streamscope:"
RETRY_PAUSE_S = 0.5  # after a batch failed to reach Redis
# Compare-and-renew / compare-and-delete of a reader's lease (one round trip, atomic).
# A lease that is another token's, or none (taken over by a reader that has left since,
# or lapsed), is not renewed: its old holder stops.
_RENEW = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
          "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end")
# The same for an owner lease, never shortening it (Redis 7's GT): a renewal in flight as
# the stream ends must not cut the longer life ``_keep_owner`` gave the ended stream's key.
_RENEW_LONGER = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
                 "redis.call('pexpire', KEYS[1], ARGV[2], 'GT') return 1 else return 0 end")
_RELEASE = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('del', KEYS[1]) else return 0 end")
# Delete a stream's keys unless another replica owns it (took it over while this one
# stalled): its log is that owner's now. KEYS: owner, then the others; ARGV: our token.
_EXPIRE = """
local owner = redis.call('get', KEYS[1])
if owner and owner ~= ARGV[1] then return 0 end
return redis.call('del', unpack(KEYS))
"""
# Take a stream over from an owner whose lease lapsed (failover), atomically: exactly one
# replica's SET succeeds. Only a stream whose owner key is gone, whose rebuild spec and
# events are there, and whose last event does not end it. KEYS: owner, events, spec.
_TAKE_OVER = """
if redis.call('exists', KEYS[1]) == 1 or redis.call('exists', KEYS[3]) == 0 then
  return 0
end
local last = redis.call('xrevrange', KEYS[2], '+', '-', 'COUNT', 1)
if #last == 0 then return 0 end
local fields = last[1][2]
for i = 1, #fields, 2 do
  if fields[i] == 'e' and fields[i + 1] == '1' then return 0 end
end
redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

Op = Callable[[Any], None]  # queues one command on a redis-py pipeline


def events_key(stream_id: str) -> str:
    return f"{KEY_PREFIX}{{{stream_id}}}:events"


def reader_key(stream_id: str) -> str:
    return f"{KEY_PREFIX}{{{stream_id}}}:reader"


def owner_key(stream_id: str) -> str:
    return f"{KEY_PREFIX}{{{stream_id}}}:owner"


def spec_key(stream_id: str) -> str:
    return f"{KEY_PREFIX}{{{stream_id}}}:spec"


@dataclass(frozen=True, slots=True)
class RedisLogStatistics:
    pending: int  # commands queued, not yet written
    batches: int  # pipelines written
    commands: int  # commands written
    errors: int  # batches that failed to reach Redis (then tried again)


class RedisEventLog:
    """``SharedEventLog`` in Redis Streams (see the module docstring).

    Args:
        client: a redis-py client (``decode_responses=False``); its pool needs
            ``max_readers + 1`` connections.
        ttl_s: how long a stream's keys live after its owner last touched them.
        lease_s: a remote reader's lease.
        follow_wait_s: one XREAD BLOCK at most (a follower renews its lease between).
        owner_lease_s: the owner's lease on the streams it generates (failover).
    """

    def __init__(
        self, client: redis.Redis, *, ttl_s: float, lease_s: float = 5.0,
        follow_wait_s: float = 1.0, max_readers: int = 16, owner_lease_s: float = 3.0,
    ) -> None:
        if not (0 < ttl_s < math.inf and 0 < follow_wait_s < lease_s < math.inf
                and 0 < owner_lease_s < math.inf):
            raise ValueError("need 0 < ttl_s < inf, 0 < follow_wait_s < lease_s < inf "
                             "and 0 < owner_lease_s < inf")
        self.lease_s = lease_s
        self.ttl_s = ttl_s
        self.follow_wait_s = follow_wait_s
        self.owner_lease_s = owner_lease_s
        # A third of the shortest: a lease outlives two missed renewals (a long step, a
        # Redis blip of up to RETRY_PAUSE_S) before anyone takes it for dead.
        self.refresh_s = min(ttl_s, lease_s, owner_lease_s) / 3
        self.owner_token = secrets.token_hex(8)  # this replica, as an owner
        self._owned: set[str] = set()  # streams it generates: their owner lease is renewed
        # Told (sync) of a stream whose owner lease another replica took (see run).
        self.on_lost: Callable[[str], None] | None = None
        self._client = client
        self._local = MemoryEventLog()
        self._last: dict[str, bool] = {}  # stream id -> its last event is logged
        self._ops: list[Op] = []
        self._local_leases: dict[str, str] = {}  # stream id -> token of a reader here
        self._touched: set[str] = set()  # keys appended to since the last batch was taken
        # stream id -> token of a new stream's lease whose SET is queued, or in flight:
        # renewing it needs no round trip (and would find no lease yet).
        self._setting: dict[str, str] = {}
        self._setting_in_flight: dict[str, str] = {}
        self._wake = trio.Event()
        self._queued = self._written = 0  # commands queued, and written, since the start
        self._batch_done = trio.Event()  # set (and replaced) after each batch written
        self._writer = trio.Lock()
        self._stopped = False  # a write was abandoned: nothing more may be written
        self._read_limiter = trio.CapacityLimiter(max_readers)
        self._renew = client.register_script(_RENEW)
        self._renew_longer = client.register_script(_RENEW_LONGER)
        self._release = client.register_script(_RELEASE)
        self._take_over = client.register_script(_TAKE_OVER)
        self._expire = client.register_script(_EXPIRE)
        self._batches = self._commands = self._errors = 0

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

    # -- EventLog: the owner's side, sync, never a checkpoint ------------------------

    def publish(self, stream_id: str, spec: bytes) -> None:
        """A new stream this replica generates: its rebuild spec (what another replica
        needs to continue it) and this replica's owner lease, queued before its first
        event, so that a stream in the store always has both. Sync, no checkpoint."""
        keys, token = (spec_key(stream_id), owner_key(stream_id)), self.owner_token
        ttl_ms, lease_ms = self._ms(self.ttl_s), self._ms(self.owner_lease_s)
        self._owned.add(stream_id)

        def op(pipe: Any) -> None:
            pipe.set(keys[0], spec, px=ttl_ms)
            pipe.set(keys[1], token, px=lease_ms)

        self._queue(op)

    def append(self, stream_id: str, n: int, data: bytes, *, last: bool = False) -> None:
        self._local.append(stream_id, n, data)  # raises on a gap or a duplicate
        self._last[stream_id] = last
        key = events_key(stream_id)
        fields = {"d": data, "e": b"1" if last else b"0"}
        self._touched.add(key)  # its time to live is set once per batch
        self._queue(lambda pipe: pipe.xadd(key, fields, id=f"0-{n}"))
        if last:  # ended: nothing left to take over; the owner key lives with the events
            self._owned.discard(stream_id)
            self._queue(partial(self._keep_owner, stream_id, self._ms(self.ttl_s)))

    def read_after(self, stream_id: str, n: int) -> list[bytes] | None:
        return self._local.read_after(stream_id, n)

    def expire(self, stream_id: str) -> int:
        """Forget a stream: its local copy, and its keys in the store unless another
        replica owns it now (one that took it over while this one stalled, then this one
        finished it before a renewal could tell: its keys are that owner's)."""
        self._last.pop(stream_id, None)
        self._local_leases.pop(stream_id, None)
        self._owned.discard(stream_id)
        keys = [owner_key(stream_id), events_key(stream_id), reader_key(stream_id),
                spec_key(stream_id)]
        token = self.owner_token
        self._queue(lambda pipe: self._expire(keys=keys, args=[token], client=pipe))
        return self._local.expire(stream_id)

    @property
    def total_bytes(self) -> int:
        return self._local.total_bytes

    def statistics(self) -> RedisLogStatistics:
        return RedisLogStatistics(len(self._ops), self._batches, self._commands, self._errors)

    # -- the writer ------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Write the queue in order until cancelled; refresh held streams' time to live.

        Cancellation: as ``flush``'s; the log then writes nothing more.
        """
        task_status.started()
        next_refresh = trio.current_time() + self.refresh_s
        while True:
            with trio.move_on_at(next_refresh):
                await self._wake.wait()
            self._wake = trio.Event()
            renew = trio.current_time() >= next_refresh
            if renew:
                self._queue_refresh()
                next_refresh = trio.current_time() + self.refresh_s
            await self.flush()
            if renew:
                await self._renew_owned()

    async def _renew_owned(self) -> None:
        """Renew the owner lease of every stream this replica generates (compare-and-
        renew); one whose lease another replica took (this one stalled past it) is let
        go: ``on_lost`` is told, and nothing of it is touched in the store again.

        Runs after a flush, which wrote every queued ``publish``: no lease is renewed
        before it was set. Without an answer from the store, nothing changes.
        Cancellation: as ``_read``'s; nothing changes.
        """
        owned = list(self._owned)
        if not owned or self._stopped:
            return
        try:
            held = await self._read(self._renew_owners, owned, self._ms(self.owner_lease_s))
        except StoreUnavailable:
            return
        for stream_id, still in zip(owned, held, strict=True):
            if not still and stream_id in self._owned:
                self._owned.discard(stream_id)
                log.warning("resume log: another replica took stream %s over", stream_id)
                if self.on_lost is not None:
                    self.on_lost(stream_id)

    def _renew_owners(self, owned: list[str], lease_ms: int) -> list[bool]:
        """In a reader thread: one pipeline of compare-and-renews."""
        pipe = self._client.pipeline(transaction=False)
        for stream_id in owned:
            self._renew_longer(keys=[owner_key(stream_id)], args=[self.owner_token, lease_ms],
                               client=pipe)
        return [bool(result) for result in pipe.execute()]

    async def flush(self) -> None:
        """Write everything queued now, in order (a failed batch is tried again).

        One writer at a time (a lock held across a batch's retries): a later batch
        never reaches Redis before an earlier one, whoever calls.

        Cancellation: the batch in flight is abandoned to its thread (a stop does not
        wait for a Redis that does not answer) and the log writes nothing more, so no
        later batch can overtake it; what is left expires by its time to live.
        """
        async with self._writer:
            while self._ops and not self._stopped:
                batch, touched, setting = self._ops, self._touched, self._setting
                self._ops, self._touched, self._setting = [], set(), {}
                queued = self._queued
                self._setting_in_flight = setting
                ttl_ms = self._ms(self.ttl_s)
                batch.extend(partial(_pexpire, key, ttl_ms) for key in touched)
                try:
                    await self._write_until_written(batch)
                except trio.Cancelled:
                    self._stopped = True  # this batch may never land: none may follow
                    self._batch_done.set()  # a waiting ``stored`` raises
                    raise
                self._setting_in_flight = {}
                self._batches += 1
                self._written = queued
                self._batch_done.set()
                self._batch_done = trio.Event()

    async def stored(self) -> None:
        """Return once every command queued before the call is in Redis (written by
        ``run``'s flushes; this call writes nothing itself).

        Raises:
            StoreUnavailable: the log stopped writing (a flush was cancelled).

        Cancellation: nothing changes; the writer goes on.
        """
        mark = self._queued
        while self._written < mark:
            if self._stopped:
                raise StoreUnavailable("the resume log stopped writing")
            await self._batch_done.wait()
        await trio.lowlevel.checkpoint()

    async def _write_until_written(self, batch: list[Op]) -> None:
        while True:
            try:
                await trio.to_thread.run_sync(self._write, batch, abandon_on_cancel=True)
                return
            except redis.RedisError as exc:
                self._errors += 1
                log.warning("resume log: a batch of %d did not reach Redis (%r); "
                            "trying again", len(batch), exc)
                await trio.sleep(RETRY_PAUSE_S)

    def _write(self, batch: list[Op]) -> None:
        """In a worker thread: one pipeline, no transaction (order is kept anyway)."""
        pipe = self._client.pipeline(transaction=False)
        for op in batch:
            op(pipe)
        results = pipe.execute(raise_on_error=False)
        self._commands += len(results)
        for result in results:
            # An XADD at an id already there: a batch tried again after it partly
            # applied. Anything else is a bug or a misconfigured server: say so.
            if isinstance(result, redis.ResponseError) and "equal or smaller" not in str(result):
                log.error("resume log: Redis refused a command: %r", result)

    def _queue(self, op: Op) -> None:
        self._ops.append(op)
        self._queued += 1
        self._wake.set()

    def _queue_refresh(self) -> None:
        """The held streams' time to live (an ended one's owner key too), and the
        leases of this replica's readers."""
        keys = [k for s in self._last for k in (events_key(s), spec_key(s))]
        ended = [s for s, last in self._last.items() if last]
        ttl_ms = self._ms(self.ttl_s)
        leases, lease_ms = list(self._local_leases.items()), self._ms(self.lease_s)

        def op(pipe: Any) -> None:
            for key in keys:
                pipe.pexpire(key, ttl_ms)
            for stream_id in ended:
                self._keep_owner(stream_id, ttl_ms, pipe)
            for stream_id, token in leases:
                self._renew(keys=[reader_key(stream_id)], args=[token, lease_ms], client=pipe)

        if keys or leases:
            self._queue(op)

    def _keep_owner(self, stream_id: str, ttl_ms: int, pipe: Any) -> None:
        """An ended stream's owner key lives as long as its events, if it is still this
        replica's (compare-and-renew): so ``expire`` can tell whose keys they are."""
        self._renew(keys=[owner_key(stream_id)], args=[self.owner_token, ttl_ms], client=pipe)

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
        if token in (self._setting.get(stream_id), self._setting_in_flight.get(stream_id)):
            await trio.lowlevel.checkpoint()
            return True  # its SET is on its way
        return bool(await self._read(self._renew, keys=[reader_key(stream_id)],
                                     args=[token, self._ms(self.lease_s)]))

    def hold_local_reader(self, stream_id: str, token: str, *, claimed: bool) -> None:
        key, lease_ms = reader_key(stream_id), self._ms(self.lease_s)
        self._local_leases[stream_id] = token
        if not claimed:  # a new stream: nobody else knows its id yet
            self._setting[stream_id] = token
            self._queue(lambda pipe: pipe.set(key, token, px=lease_ms))

    def release_local_reader(self, stream_id: str) -> None:
        token = self._local_leases.pop(stream_id, None)
        if token is not None:
            self.release_reader(stream_id, token)

    def release_reader(self, stream_id: str, token: str) -> None:
        key = reader_key(stream_id)
        self._queue(lambda pipe: self._release(keys=[key], args=[token], client=pipe))

    # -- failover: a stream whose owner died ----------------------------------------

    async def owner_alive(self, stream_id: str) -> bool:
        return bool(await self._read(self._client.exists, owner_key(stream_id)))

    async def take_over(self, stream_id: str) -> bool:
        lease_ms = self._ms(self.owner_lease_s)
        won = bool(await self._read(self._take_over, keys=[
            owner_key(stream_id), events_key(stream_id), spec_key(stream_id)],
            args=[self.owner_token, lease_ms]))
        if won:
            self._owned.add(stream_id)  # renewed from now on
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
        self._owned.discard(stream_id)
        return self._local.expire(stream_id)  # the store's keys are the new owner's

    def release_owner(self, stream_id: str) -> None:
        self._owned.discard(stream_id)
        key, token = owner_key(stream_id), self.owner_token
        self._queue(lambda pipe: self._release(keys=[key], args=[token], client=pipe))

    async def reader_held(self, stream_id: str) -> bool:
        return bool(await self._read(self._client.exists, reader_key(stream_id)))

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


def _pexpire(key: str, ttl_ms: int, pipe: Any) -> None:
    pipe.pexpire(key, ttl_ms)


def _entry(entry: Any) -> tuple[int, bytes, bool]:
    """(n, data, last) of one XRANGE/XREAD entry ``(b"0-<n>", {b"d": ..., b"e": ...})``."""
    entry_id, fields = entry
    return int(entry_id.split(b"-")[1]), fields[b"d"], fields[b"e"] == b"1"
