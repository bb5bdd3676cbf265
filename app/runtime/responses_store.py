"""Stored responses (``POST /v1/responses`` with ``store``): kept for a bounded time,
bounded per API key, in memory or in the Redis the replicas share.

A stored response is one record (``StoredResponse``, ``stored_response.py``: the response
object, its input items, and the conversation it continues: what
``previous_response_id`` builds on), kept in its JSON form under the response's id and
the name of the key that made it (``owner``: its count and bytes are what the bounds
limit). Whether a request may see an id is the id's business (an API key's ids carry
its tag, ``app.auth.may_see``); the store only keeps records.

Two stores, chosen as the resume log is (``store.py``): ``MemoryResponses`` in this
process, and with ``STREAMSCOPE_RESUME_STORE`` ``RedisResponses``, where any replica
finds a response another made (background responses are resumed from any replica).
``RedisResponses`` talks to Redis through the replica's one ``streams.resume.RedisStore``,
the resume log's: its client (its pool keeps connections for these calls, apart from the
log's readers) and its signer. Redis holds each record signed with the replicas' shared
secret (``StoreSigner.sign_value``, kind ``response``, under the response's id), as the
resume log's specs and events are: a record that fails its check (altered, another id's,
another secret's, or unsigned) is treated as absent. The bounds are checked and the
record written in one Lua script, so replicas racing for a key's last slot cannot both
win. Every record expires ``ttl_s`` after its last write.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import trio

from streams.resume import StoreRejected, StoreUnavailable

from ..settings import Settings
from .stored_response import StoredResponse

if TYPE_CHECKING:
    from streams.resume import RedisStore

log = logging.getLogger("streamscope.responses")

KEY_PREFIX = "streamscope:response:"
SIGNED_KIND = "response"  # what a stored record is signed as (StoreSigner.sign_value)


class ResponsesFull(Exception):
    """The key's stored responses are at their bound (count or bytes)."""


class ResponseStoreUnavailable(Exception):
    """The shared store did not answer."""


@dataclass(frozen=True, slots=True)
class StoreBounds:
    """How long a response is kept and how much each key may keep."""

    ttl_s: float
    max_count: int
    max_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings) -> StoreBounds:
        return cls(settings.responses_ttl_s, settings.responses_max_stored,
                   settings.responses_max_bytes)


class ResponseStore(Protocol):
    """Where stored responses live. The methods checkpoint (Redis: a thread)."""

    bounds: StoreBounds

    async def put(self, record: StoredResponse) -> None:
        """File (or replace) ``record`` under its id and owner; its time to live starts
        again.

        Raises: ResponsesFull (nothing written); ResponseStoreUnavailable.
        Cancellation: abandoned (the shared store's call runs on in its thread) or, in
        memory, nothing to undo: the write is one Redis script, so it lands whole or not
        at all, and a record nobody learned of expires in ``ttl_s``.
        """
        ...

    async def get(self, response_id: str) -> StoredResponse | None:
        """The record, or None (never stored, expired, deleted; in Redis, one that fails
        its signature's check).
        Raises: ResponseStoreUnavailable. Cancellation: nothing to undo: a read
        (abandoned to its thread, in Redis)."""
        ...

    async def delete(self, owner: str, response_id: str) -> bool:
        """Forget the record; False if there was none.
        Raises: ResponseStoreUnavailable. Cancellation: abandoned, in Redis: one script,
        so it lands whole or not; asked again, idempotent."""
        ...


def full_message(bounds: StoreBounds, why: str) -> str:
    return (f"this API key stores {why} (at most {bounds.max_count} responses and "
            f"{bounds.max_bytes} bytes, each kept {bounds.ttl_s:g} s): delete some "
            f"(DELETE /v1/responses/<id>), or send store: false")


class MemoryResponses:
    """``ResponseStore`` in this process's memory."""

    def __init__(self, bounds: StoreBounds) -> None:
        self.bounds = bounds
        self._docs: dict[str, tuple[str, float, bytes]] = {}  # id -> (owner, expiry, data)
        self._owned: dict[str, set[str]] = {}

    async def put(self, record: StoredResponse) -> None:
        await trio.lowlevel.checkpoint()
        data, response_id = record.to_json(), record.id
        mine = self._purged(record.owner)
        old = self._docs.get(response_id)
        used = sum(len(self._docs[i][2]) for i in mine) - (len(old[2]) if old else 0)
        if old is None and len(mine) >= self.bounds.max_count:
            raise ResponsesFull(full_message(self.bounds, f"{len(mine)} responses"))
        if used + len(data) > self.bounds.max_bytes:
            raise ResponsesFull(full_message(self.bounds, f"{used} bytes"))
        self._docs[response_id] = (record.owner, trio.current_time() + self.bounds.ttl_s,
                                   data)
        mine.add(response_id)

    async def get(self, response_id: str) -> StoredResponse | None:
        await trio.lowlevel.checkpoint()
        entry = self._docs.get(response_id)
        if entry is None:
            return None
        if entry[1] <= trio.current_time():
            self._forget(response_id)
            return None
        return StoredResponse.from_json(entry[2])  # its own copy, as Redis's would be

    async def delete(self, owner: str, response_id: str) -> bool:
        await trio.lowlevel.checkpoint()
        return self._forget(response_id)

    def _forget(self, response_id: str) -> bool:
        entry = self._docs.pop(response_id, None)
        if entry is None:
            return False
        self._owned.get(entry[0], set()).discard(response_id)
        return True

    def _purged(self, owner: str) -> set[str]:
        """The owner's ids, the expired ones forgotten."""
        mine = self._owned.setdefault(owner, set())
        now = trio.current_time()
        for response_id in [i for i in mine if self._docs[i][1] <= now]:
            self._forget(response_id)
        return mine


# KEYS: the record, the owner's ids (a sorted set: id -> expiry ms), the owner's
# bytes (a hash: id -> bytes). ARGV: id, data (signed), now ms, ttl ms, max count, max
# bytes, the record's bytes (its signature not counted).
# Returns 0 (written), 1 (count bound), 2 (bytes bound).
_PUT_LUA = """
local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[3])
for _, id in ipairs(expired) do redis.call('HDEL', KEYS[3], id) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[3])
local old = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
local total = 0
for _, b in ipairs(redis.call('HVALS', KEYS[3])) do total = total + tonumber(b) end
if old == 0 and redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[5]) then return 1 end
if total - old + tonumber(ARGV[7]) > tonumber(ARGV[6]) then return 2 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[4])
redis.call('ZADD', KEYS[2], tonumber(ARGV[3]) + tonumber(ARGV[4]), ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[7])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
redis.call('PEXPIRE', KEYS[3], ARGV[4])
return 0
"""
_DELETE_LUA = """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
return redis.call('DEL', KEYS[1])
"""


class RedisResponses:
    """``ResponseStore`` in the shared Redis (see the module docstring), on the replica's
    one ``RedisStore``. Calls run in worker threads (``RedisStore.call``); a cancelled
    call is abandoned to its thread (it lands or not)."""

    def __init__(self, shared: RedisStore, bounds: StoreBounds) -> None:
        self.bounds = bounds
        self.shared = shared
        self._put = shared.client.register_script(_PUT_LUA)
        self._delete = shared.client.register_script(_DELETE_LUA)

    def _keys(self, owner: str, response_id: str) -> list[str]:
        tag = hashlib.sha256(owner.encode()).hexdigest()[:16]
        return [f"{KEY_PREFIX}{response_id}", f"{KEY_PREFIX}owner:{tag}",
                f"{KEY_PREFIX}owner:{tag}:bytes"]

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Cancellation: abandoned to its thread (``RedisStore.call``)."""
        try:
            return await self.shared.call(fn, *args, **kwargs)
        except StoreUnavailable as exc:
            raise ResponseStoreUnavailable(f"the shared store does not answer: {exc}") from exc

    async def put(self, record: StoredResponse) -> None:
        data, response_id = record.to_json(), record.id
        signed = self.shared.signer.sign_value(SIGNED_KIND, response_id, data)
        now_ms = int(time.time() * 1000)
        result = await self._call(
            self._put, keys=self._keys(record.owner, response_id),
            args=[response_id, signed, now_ms, int(self.bounds.ttl_s * 1000),
                  self.bounds.max_count, self.bounds.max_bytes, len(data)])
        if result == 1:
            raise ResponsesFull(full_message(self.bounds, f"{self.bounds.max_count} "
                                             "responses"))
        if result == 2:
            raise ResponsesFull(full_message(self.bounds, "too many bytes"))

    async def get(self, response_id: str) -> StoredResponse | None:
        signed = await self._call(self.shared.client.get, f"{KEY_PREFIX}{response_id}")
        if signed is None:
            return None
        try:
            data = self.shared.signer.open_value(SIGNED_KIND, response_id, bytes(signed))
        except StoreRejected:
            return None  # not written by a replica with our secret, or not for this id
        try:
            return StoredResponse.from_json(data)
        except ValueError as exc:  # signed by a replica, yet not a record this one reads
            log.warning("stored response %s unreadable: %s", response_id[:64], exc)
            return None

    async def delete(self, owner: str, response_id: str) -> bool:
        deleted = await self._call(self._delete, keys=self._keys(owner, response_id),
                                   args=[response_id])
        return bool(deleted)


def response_store(settings: Settings, shared: RedisStore | None) -> ResponseStore:
    """The store the settings choose: the shared Redis with a resume store (on the
    replica's one ``shared``, the runtime's ``shared_store``), else memory."""
    bounds = StoreBounds.from_settings(settings)
    if shared is None:
        return MemoryResponses(bounds)
    return RedisResponses(shared, bounds)
