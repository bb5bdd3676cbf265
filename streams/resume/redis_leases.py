"""The Redis log's leases: which reader follows a stream, and which replica generates it.

Why a module of its own: the leases are a protocol between replicas of their own (a token
under PX, taken, renewed by compare-and-renew, let go by compare-and-delete, taken over by
one Lua script), which the one-reader rule and the failover rest on; the log of events
(``redis_log.py``) only calls it. ``StoreLeases`` extends ``StoreReads``
(``redis_reads.py``), and ``RedisEventLog`` extends it with the writer's side.

Reader lease: a token with PX ``lease_s``: a new reader takes it over (a plain SET of its
token), and the old one finds at its next renewal (a compare-and-renew) that it is not its
own any more. A reader lease claimed by a cancelled call lapses unrenewed within
``lease_s``.

Writer lease: the token of the replica whose engine generates a stream (PX
``writer_lease_s``; the log's ``publish`` queues it before the first event). The log's
``run`` renews the writer leases (``_renew_and_look``: compare-and-renew, after a flush,
so never before their SET); at the stream's last event the writer lease gets the events'
time to live instead, refreshed with them (``_keep_writer_lease``), so the log's
``expire`` can tell whose keys they are. A renewal that fails (this replica stalled past
its lease and another took the stream over) tells ``on_lost``, and the registry stops the
stream here and ``disown``s it. The same round trip looks for the cancel marks
(``cancel_remote``, ``cancel.lua``) of the streams held here and tells ``on_cancelled``.
``take_over`` is one Lua script: the lease is SET (PX) only if it is absent, the spec is
there and the last event does not end the stream; of replicas racing, exactly one wins.
It is never abandoned when cancelled: a lease Redis granted always reaches its caller,
which owns it.

The sync calls queue their commands on the log's writer (``redis_writer.py``), in order
with the log's own.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Collection
from functools import partial
from typing import Any

import redis
import trio

from . import redis_reads
from .log import StoreUnavailable
from .redis_keys import lua, reader_key, stream_keys, writer_key
from .redis_reads import StoreReads
from .redis_writer import RedisBatchWriter
from .signing import StoreSigner

log = logging.getLogger(__name__)


class StoreLeases(StoreReads):
    """The leases of ``SharedEventLog`` (see the module docstring).

    Args:
        client: a redis-py client (``decode_responses=False``).
        signer: checks what is read (``signing.py``).
        writer: the log's queue of commands, which the lease commands join.
        ttl_s: the keys' time to live.
        lease_s: a reader's lease.
        writer_lease_s: the lease of the replica generating a stream (failover).
        max_readers: reader threads at most (the client's pool needs one more).
    """

    def __init__(self, client: redis.Redis, signer: StoreSigner, writer: RedisBatchWriter,
                 *, ttl_s: float, lease_s: float, writer_lease_s: float,
                 max_readers: int) -> None:
        super().__init__(client, signer, ttl_s=ttl_s, max_readers=max_readers)
        self.lease_s = lease_s
        self.writer_lease_s = writer_lease_s
        self.writer_token = secrets.token_hex(8)  # this replica, as a stream's writer
        self._writing: set[str] = set()  # streams it generates: their writer lease is renewed
        # Told (sync) of a stream whose writer lease another replica took (see
        # _renew_and_look), and of one a DELETE on another replica cancelled.
        self.on_lost: Callable[[str], None] | None = None
        self.on_cancelled: Callable[[str], None] | None = None
        self._local_leases: dict[str, str] = {}  # stream id -> token of a reader here
        self._writer = writer
        self._renew = client.register_script(lua("renew"))
        self._renew_longer = client.register_script(lua("renew_longer"))
        self._release = client.register_script(lua("release"))
        self._take_over = client.register_script(lua("take_over"))

    # -- SharedEventLog: any replica's readers' leases (its reads: ``StoreReads``) -------

    async def claim_reader(self, stream_id: str, token: str) -> None:
        """``SharedEventLog.claim_reader``: a plain SET of ``token``.

        Cancellation: abandoned; the SET may still land, unknown to the caller, who
        lets ``token`` go (``release_reader``) on its way out, or else it lapses
        unrenewed within ``lease_s``.
        """
        await self._read(self._client.set, reader_key(stream_id), token,
                         px=self._ms(self.lease_s))

    async def renew_reader(self, stream_id: str, token: str) -> bool:
        """``SharedEventLog.renew_reader`` (compare-and-renew).

        Cancellation: abandoned; the lease may be renewed once more, and lapses within
        ``lease_s`` unless its reader's close lets it go first.
        """
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

    def _renew_readers(self, leases: list[tuple[str, str]], pipe: Any) -> None:
        """The compare-and-renew of each (stream id, token) of this replica's readers,
        on ``pipe`` (the log's refresh)."""
        lease_ms = self._ms(self.lease_s)
        for stream_id, token in leases:
            self._renew(keys=[reader_key(stream_id)], args=[token, lease_ms], client=pipe)

    # -- failover: the writer lease -------------------------------------------------

    async def take_over(self, stream_id: str) -> bool:
        """``SharedEventLog.take_over`` (``take_over.lua``); a won lease is renewed by
        ``run`` from then on.

        Cancellation: finished first, not abandoned (issue 34, D1): a lease Redis
        granted while the call was cancelled (a client gone, a wait run out) would be
        held with nobody writing the stream or renewing it, and the stream would stall
        until it lapsed. The cancel waits for Redis's answer (the client's socket
        timeout bounds it) and the call returns it: the caller owns a won lease
        (``Failover.continue_here`` lets it go if cancelled before the stream opens).
        """
        lease_ms = self._ms(self.writer_lease_s)
        won = bool(await self._call(partial(self._take_over, keys=stream_keys(stream_id),
                                            args=[self.writer_token, lease_ms]),
                                    abandon=False))  # a granted lease is never lost
        if won:
            self._writing.add(stream_id)  # renewed from now on
        return won

    def release_writer(self, stream_id: str) -> None:
        self._writing.discard(stream_id)
        key, token = writer_key(stream_id), self.writer_token
        self._writer.queue(lambda pipe: self._release(keys=[key], args=[token], client=pipe))

    async def _renew_and_look(self, held: Collection[str]) -> None:
        """Renew (compare-and-renew) the writer lease of each stream this replica
        generates, after a flush (so never before its SET), and look for cancel marks
        on each it holds (``held``, as it is now and after the round trip): one whose
        lease another replica took (this one stalled past it) is let go (``on_lost``;
        nothing of it is touched in the store again), one still held and marked is
        cancelled (``on_cancelled``; ``expire`` then deletes its keys).
        Without an answer from the store, nothing changes. Cancellation: abandoned (a
        renewal lands whole or not), with nothing to undo: the next round renews again."""
        writing, held_now = list(self._writing), list(held)
        if not (writing or held_now) or self._writer.stopped:
            return
        try:
            renewed, marked = await self._read(
                redis_reads.renew_and_look, self._client, self._renew_longer,
                self.writer_token, writing, held_now, self._ms(self.writer_lease_s))
        except StoreUnavailable:
            return
        for stream_id, still in zip(writing, renewed, strict=True):
            if not still and stream_id in self._writing:
                self._writing.discard(stream_id)
                log.warning("resume log: another replica took stream %s over", stream_id)
                if self.on_lost is not None:
                    self.on_lost(stream_id)
        for stream_id, cancelled in zip(held_now, marked, strict=True):
            if cancelled and stream_id in held and self.on_cancelled is not None:
                self.on_cancelled(stream_id)

    def _keep_writer_lease(self, stream_id: str, ttl_ms: int, pipe: Any) -> None:
        """An ended stream's writer lease lives as long as its events, if it is still
        this replica's (compare-and-renew): so ``expire`` can tell whose keys they are."""
        self._renew(keys=[writer_key(stream_id)], args=[self.writer_token, ttl_ms],
                    client=pipe)

    def _forget_leases(self, stream_id: str) -> None:
        """This replica holds no lease of the stream any more (the log forgets it)."""
        self._local_leases.pop(stream_id, None)
        self._writing.discard(stream_id)
