"""The Redis log's writer: the queue of commands its sync side makes, written in order.

``RedisEventLog.append`` and friends are sync and never a checkpoint (the registry logs
an item in the same step as it takes it), so they only queue commands here; ``flush``
writes the queue in order, one MULTI/EXEC transaction per batch, in a worker thread: a
batch lands whole or not at all, so a connection cut mid-batch never leaves an event's
key without its time to live (each key appended to gets its PEXPIRE at the batch's
end, inside the same transaction). A batch that fails to reach Redis is tried again, in
order, after a pause (the explicit ids make a batch that landed but whose answer was
lost safe to repeat); the failures are counted (``statistics``).

Bounded: at most ``max_pending`` commands wait (besides the batch in flight). Past it,
``queue`` takes nothing (counted in ``dropped``: a lease renewal, a refresh, a delete,
each of which the keys' times to live make up for), and the log ends the stream whose
event cannot be queued (``StoreFull``, ``redis_log.py``): during an outage the memory a
replica holds for the store stays bounded, and its streams end with an error event
instead of the queue growing until the process dies.

Threads: redis-py's sync client, called through ``trio.to_thread.run_sync`` with a lock
(one batch at a time, in order). A cancelled flush abandons its batch to the thread and
stops the writer for good: no later batch may overtake one that may still land.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import redis
import trio

from .log import StoreStatistics, StoreUnavailable

log = logging.getLogger(__name__)

RETRY_PAUSE_S = 0.5  # after a batch failed to reach Redis

Op = Callable[[Any], None]  # queues one command on a redis-py pipeline


class RedisBatchWriter:
    """Redis commands queued by sync callers, written in order by ``flush``.

    Args:
        client: the redis-py client the batches go through.
        ttl_ms: the time to live each key ``touch``ed in a batch gets at its end.
        max_pending: the most commands queued (besides the batch in flight).
    """

    def __init__(self, client: redis.Redis, *, ttl_ms: int, max_pending: int) -> None:
        if max_pending < 1:
            raise ValueError("max_pending must be >= 1")
        self._client = client
        self._ttl_ms = ttl_ms
        self._max_pending = max_pending
        self._ops: list[Op] = []
        self._touched: set[str] = set()  # keys appended to since the last batch was taken
        # stream id -> token of a new stream's reader lease whose SET is queued, or in
        # flight: renewing it needs no round trip (and would find no lease yet).
        self._setting: dict[str, str] = {}
        self._setting_in_flight: dict[str, str] = {}
        self._wake = trio.Event()
        self._queued = self._written = 0  # commands queued, and written, since the start
        self._batch_done = trio.Event()  # set (and replaced) after each batch written
        self._lock = trio.Lock()
        self._stopped = False  # a write was abandoned: nothing more may be written
        self._batches = self._commands = self._errors = 0
        self._refused = self._dropped = 0

    @property
    def stopped(self) -> bool:
        """A flush was cancelled: this writer writes nothing more."""
        return self._stopped

    def has_room(self) -> bool:
        """Whether ``queue`` takes a command now."""
        return len(self._ops) < self._max_pending

    def queue(self, op: Op) -> bool:
        """Queue one command (sync, never a checkpoint); False (and counted as dropped)
        if ``max_pending`` wait already."""
        if not self.has_room():
            self._dropped += 1
            return False
        self._ops.append(op)
        self._queued += 1
        self._wake.set()
        return True

    def touch(self, key: str) -> None:
        """``key`` gets the time to live at the end of the batch that takes it (in the
        same transaction as its appends)."""
        self._touched.add(key)

    def setting(self, stream_id: str, token: str) -> None:
        """A new stream's reader lease is SET for ``token`` by a command queued now."""
        self._setting[stream_id] = token

    def is_setting(self, stream_id: str, token: str) -> bool:
        """Whether ``token``'s lease SET is queued or in flight (so it counts as held)."""
        return token in (self._setting.get(stream_id), self._setting_in_flight.get(stream_id))

    async def wait_for_work(self, until: float) -> None:
        """Return once something was queued since the last call, or at ``until``
        (Trio time). Cancellation: nothing to undo: it only waits."""
        with trio.move_on_at(until):
            await self._wake.wait()
        self._wake = trio.Event()

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(pending=len(self._ops), batches=self._batches,
                               commands=self._commands, failed_batches=self._errors,
                               refused=self._refused, dropped=self._dropped)

    async def flush(self) -> None:
        """Write everything queued now, in order (a failed batch is tried again).

        One writer at a time (a lock held across a batch's retries): a later batch
        never reaches Redis before an earlier one, whoever calls.

        Cancellation: the batch in flight is abandoned to its thread (a stop does not
        wait for a Redis that does not answer) and the log writes nothing more, so no
        later batch can overtake it; what is left expires by its time to live.
        """
        async with self._lock:
            while self._ops and not self._stopped:
                batch, touched, setting = self._ops, self._touched, self._setting
                self._ops, self._touched, self._setting = [], set(), {}
                queued = self._queued
                self._setting_in_flight = setting
                batch.extend(partial(_pexpire, key, self._ttl_ms) for key in touched)
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
        someone's flush; this call writes nothing itself).

        Raises:
            StoreUnavailable: the writer stopped (a flush was cancelled).

        Cancellation: nothing to undo: it only waits for the writer, which goes on.
        """
        mark = self._queued
        while self._written < mark:
            if self._stopped:
                raise StoreUnavailable("the resume log stopped writing")
            await self._batch_done.wait()
        await trio.lowlevel.checkpoint()

    async def _write_until_written(self, batch: list[Op]) -> None:
        """Write ``batch`` in a thread, trying again after ``RETRY_PAUSE_S`` until Redis
        takes it.

        Cancellation: the write in flight is abandoned to its thread (it may still land,
        whole: a transaction); ``flush`` then stops the writer so no batch overtakes it.
        """
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
        """In a worker thread: one pipeline in a MULTI/EXEC transaction (whole or not at
        all; commands Redis refuses inside it fail alone, and are counted)."""
        pipe = self._client.pipeline(transaction=True)
        for op in batch:
            op(pipe)
        results = pipe.execute(raise_on_error=False)
        self._commands += len(results)
        for result in results:
            # An XADD at an id already there: a batch tried again after it partly
            # applied. Anything else is a bug or a misconfigured server: say so.
            if isinstance(result, redis.ResponseError) and "equal or smaller" not in str(result):
                self._refused += 1
                log.error("resume log: Redis refused a command: %r", result)


def _pexpire(key: str, ttl_ms: int, pipe: Any) -> None:
    pipe.pexpire(key, ttl_ms)
