"""Failover: this replica continues a stream whose writer died.

A resume on this replica of a stream that has not ended, whose writer lease lapsed,
takes the stream over in one atomic operation of the store (``SharedEventLog.take_over``:
exactly one replica wins; a loser follows the log as a remote reader). The winner reads
the spec and every event, and calls the app's ``Rebuild``, which opens the stream again
continuing after those events and hands it to ``Adopt`` in the same call: from then on
this replica writes it, appending to the same log with the next numbers, so readers
anywhere go on with the same event ids.

What the store holds is not trusted: the spec and every event are checked against their
HMAC as they are read (``signing.py``), and the app's rebuild validates the spec as it
validates an HTTP request. A stream whose spec or events are refused is not continued:
the lease is let go, ``spec_rejected`` counts it, and its reader gets the app's refusal
event (``Rebuild.refusal``) and nothing else.
"""

from __future__ import annotations

import logging
import secrets

from ..stream import TokenStream
from .errors import NothingToResume, StoreRejected
from .local import LocalStreams
from .log import SharedEventLog
from .reader import Reader
from .records import Encode, Observer, Rebuild
from .remote_reader import RemoteReader

log_ = logging.getLogger(__name__)


class Failover:
    """Continues here the streams of dead writers (see the module docstring)."""

    def __init__(self, log: SharedEventLog, local: LocalStreams) -> None:
        self._log = log
        self._local = local
        self.failovers = self.spec_rejected = 0

    async def continue_here(
        self, rebuild: Rebuild, request_id: str, after: int
    ) -> Reader | RemoteReader:
        """This replica won the writer lease of a stream whose writer died: rebuild it
        from the store and continue it here, appending to the same log; its reader from
        event ``after + 1`` (which may be past the store's last: the dead writer's log
        lagged its reader; those events are made again, the same, and skipped). A spec
        or events refused (``StoreRejected``): a reader of the refusal event alone.

        Raises:
            NothingToResume: the store no longer holds the stream.
            Whatever ``rebuild`` raises (opening the stream).

        Cancellation: before the stream opens, nothing to undo but the writer lease won,
        which is let go (another resume may take over at once, not a lease later); once
        open, handed over: the registry holds it (a cancelled claim of the reader lease
        detaches it, as a reader that left).
        """
        log = self._log
        adopted: list[Reader] = []

        def adopt(stream: TokenStream, encode: Encode, observer: Observer | None) -> None:
            reader = self._local.add(stream, encode, observer, token=secrets.token_hex(8),
                                     after=after, logged=events, published=True)
            log.adopt(request_id, events)  # its local copy: the events in the store
            adopted.append(reader)

        try:
            got = await log.read_for_rebuild(request_id)
            if got is None:
                raise NothingToResume(request_id)
            spec, events = got
            await rebuild(request_id, spec, events, adopt)
        except StoreRejected as exc:
            assert not adopted  # refused before anything opened
            log.release_writer(request_id)
            self.spec_rejected += 1
            log_.warning("resume: stream %s is not continued here: %s", request_id, exc)
            return RemoteReader.refusing(log, request_id, rebuild.refusal(request_id, str(exc)))
        except BaseException:
            if not adopted:
                log.release_writer(request_id)
            raise
        (reader,) = adopted
        self.failovers += 1
        assert reader.token is not None
        try:
            await log.claim_reader(request_id, reader.token)
        except BaseException:
            reader.close()
            raise
        log.hold_local_reader(request_id, reader.token, claimed=True)
        return reader
