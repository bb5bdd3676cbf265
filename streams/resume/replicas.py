"""Several replicas: a reader on any replica, of a stream any replica generates.

With a ``SharedEventLog`` (Redis, ``redis_log.py``), the replica whose engine generates
a stream holds it exactly as alone (``local.py``), and its log also goes to the store. A
reader that comes back to another replica (the balancer chose it) gets a
``RemoteReader``: it replays the store after its position and follows it until the
event marked last. Every reader, here or there, holds the stream's reader lease; a new
reader takes it over and the old one learns it at its next renewal. Without an answer
from the store, the writer goes on as if alone.

A resume positioned past the store's last event is waited for (``POSITION_WAIT_S``: the
writer sends an event to its reader before its log reaches the store), and with
failover until the writer lease lapses too (a dead writer's last events may never have
reached the store; the takeover, ``failover.py``, makes them again). A replica that
drains follows no other replica's stream: its remote readers end at once (their clients
resume elsewhere) and new ones are refused with ``Draining``.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
from functools import partial

import trio

from .errors import BadPosition, Draining, NothingToResume
from .failover import Failover
from .local import LocalStreams
from .log import SharedEventLog, StoreUnavailable
from .reader import Reader
from .records import Rebuild
from .remote_reader import RemoteReader

# How long a reader on another replica waits for the shared log to reach the position
# it claims (the writer's log lags its live readers by a batch).
POSITION_WAIT_S = 2.0
# How long one read of the store waits for it to reach a position, between looks at the
# writer lease (a takeover may be due): a tenth of a second, a few round trips a second
# for the few seconds at most that a reader waits there.
POSITION_STEP_S = 0.1

log_ = logging.getLogger(__name__)


class Replicas:
    """Attaching readers through the shared log (see the module docstring)."""

    def __init__(self, log: SharedEventLog, local: LocalStreams) -> None:
        self._log = log
        self._local = local
        self._failover = Failover(log, local)
        self._remote_readers: set[RemoteReader] = set()
        self._draining = False
        self.remote_resumes = 0  # remote readers attached (local attaches count there)
        self.events_rejected = 0  # remote readers ended: an event failed its check

    @property
    def failovers(self) -> int:
        return self._failover.failovers

    @property
    def spec_rejected(self) -> int:
        return self._failover.spec_rejected

    @property
    def resumes(self) -> int:
        """Readers attached here through the store: remote ones, and failovers."""
        return self.remote_resumes + self._failover.failovers

    def drain(self) -> None:
        """End the remote readers, refuse new ones. Sync, idempotent, no checkpoint."""
        self._draining = True
        for reader in list(self._remote_readers):
            reader.close()

    async def attach(
        self, request_id: str, after: int, rebuild: Rebuild | None
    ) -> Reader | RemoteReader:
        """``ResumeRegistry.attach`` with a shared log.

        Cancellation: a local stream: the claim of the reader lease is abandoned (it
        lands or not) and its token let go (queued) whatever it did, so no lease is left
        to lapse unowned for long; once ``LocalStreams.attach`` ran, the hand-over was
        finished first (shielded) and the reader is returned, its owner's to close. A
        remote one: ``_attach_remote``'s (reads abandoned, a take-over finished first).
        """
        log = self._log
        entry = self._local.get(request_id)
        if entry is None:
            return await self._attach_remote(request_id, after, rebuild)
        self._local.check_position(entry, after)  # before the lease changes hands
        token = secrets.token_hex(8)
        try:
            with contextlib.suppress(StoreUnavailable):  # then go on as alone
                await log.claim_reader(request_id, token)
            reader = await self._local.attach(request_id, after, token)
        except BaseException:
            log.release_reader(request_id, token)
            raise
        log.hold_local_reader(request_id, token, claimed=True)
        return reader

    async def _attach_remote(
        self, request_id: str, after: int, rebuild: Rebuild | None
    ) -> Reader | RemoteReader:
        """A reader of a stream another replica generates, or, if that replica died and
        this one takes the stream over, its ``Reader`` here (see the module docstring).

        Cancellation: while it waits for the store (``tail``, ``read_remote``), nothing
        changes. The take-over is not abandoned (issue 34, D1): a lease Redis granted
        reaches this call even if a cancel or the wait's deadline came meanwhile, and
        ``Failover.continue_here`` then owns it (lets it go if cancelled before the
        stream opens). The claim of the reader lease is abandoned, and its token let go
        (queued): a SET that lands after the release lapses unrenewed within
        ``lease_s``. No ``RemoteReader`` exists until it is returned.
        """
        log = self._log
        if self._draining:
            await trio.lowlevel.checkpoint()
            raise Draining(request_id)
        tail = await log.tail(request_id)
        if tail is None:
            raise NothingToResume(request_id)
        last_n, ended = tail
        won = False
        wait_s = POSITION_WAIT_S + (log.writer_lease_s if rebuild is not None else 0.0)
        with trio.move_on_after(wait_s):
            while True:
                if not ended and rebuild is not None:
                    won = await log.take_over(request_id)  # one round trip, atomic
                    if won:
                        break
                if after <= last_n or ended:
                    break
                events = await log.read_remote(request_id, last_n, wait_s=POSITION_STEP_S)
                if events is None:
                    raise NothingToResume(request_id)
                if events:
                    last_n, _, ended = events[-1]
        # Out of the wait's scope, with no checkpoint since the take-over returned: a won
        # lease is continue_here's to own (or let go) whatever cancel came meanwhile.
        if won and rebuild is not None:
            return await self._failover.continue_here(rebuild, request_id, after)
        if after > last_n:
            raise BadPosition(f"event {after} of a stream that has made {last_n}")
        if ended and after == last_n:
            raise NothingToResume(request_id)
        token = secrets.token_hex(8)
        try:
            await log.claim_reader(request_id, token)  # taken over from any reader holding it
        except BaseException:
            log.release_reader(request_id, token)
            raise
        if self._draining:  # it began while the claim was in flight
            log.release_reader(request_id, token)
            raise Draining(request_id)
        self.remote_resumes += 1

        def rejected() -> None:
            self.events_rejected += 1
            log_.warning("resume: an event of stream %s in the store fails its HMAC",
                         request_id)

        refusal = None if rebuild is None else partial(rebuild.refusal, request_id)
        remote = RemoteReader(log, request_id, after, token,
                              on_close=self._remote_readers.discard, refusal=refusal,
                              on_rejected=rejected)
        self._remote_readers.add(remote)
        return remote
