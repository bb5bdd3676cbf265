"""Background responses (``background: true``): a resumable stream under the Responses API.

A background response runs as the resumable streams of ``POST /v1/requests`` do
(``resumable.py``), opened by the same opener (``registry_owned.open_registry_owned``):
the resume registry owns its stream from the moment it opens,
logs its items as native events (memory, or the shared Redis with its failover), and
holds it with no reader; it counts against ``max_detached_streams`` and, with API keys,
against its key's fair share of that cap (``app.key_shares``, as the other resumable
streams) and its key's ``max_streams``, until it ends. A client that reads it
(``stream: true`` at creation, or ``GET /v1/responses/<id>?stream=true``) is a reader
of that stream: its disconnect hands the stream back to the registry and cancels
nothing: it generates with no reader for ``STREAMSCOPE_RESPONSES_BACKGROUND_S`` at most
(the registry's ``hold_s``; a failover's new writer holds it for the grace period). Its Responses
events are made again from the log for every reader (``app.wire.responses_replay``),
skipping those up to ``starting_after``.

``Recorder`` is the stream's observer in the registry: it builds the response object of
the items as they are logged (its events' bytes are not made here: each reader's are,
once) and, at the last one, writes the final response object to the response store, so
``GET /v1/responses/<id>`` answers after the stream's log has expired. (A stream taken
over by another replica, after its writer died, is observed there by the failover's own
observer: its final object is written by the first ``GET`` that reads the finished log,
``responses_stored.py``.)
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from quart import Response

from ..errors import ApiError
from ..metrics import RequestTimer
from ..runtime import (
    Prepared,
    ResponsesFull,
    ResponseStore,
    ResponseStoreUnavailable,
    Runtime,
    StoredResponse,
)
from ..wire import ReplayedEvents
from .body import EventStreamBody
from .registry_owned import open_registry_owned, wait_stored
from .responses_objects import events_of, object_of
from .resume_source import ResumeSource
from .serving import json_response, sse_response

log = logging.getLogger("streamscope.responses")


class StoreWriter:
    """Writes a response's documents in the app's nursery, each write on its own (a
    write that fails is logged: the response was already answered)."""

    def __init__(self, store: ResponseStore, nursery: trio.Nursery) -> None:
        self.store = store
        self.nursery = nursery

    def forget(self, document: StoredResponse) -> None:
        """Queue the delete of ``document`` (a response refused after it was stored).
        Sync, never a checkpoint."""
        self.nursery.start_soon(self._forget, document)

    async def _forget(self, document: StoredResponse) -> None:
        """Cancellation: abandoned (only when the app's nursery stops): the delete is
        one atomic call, so it lands whole or not; an undeleted record expires."""
        try:
            await self.store.delete(document.owner, document.id)
        except ResponseStoreUnavailable as exc:
            log.warning("response %s not deleted: %s", document.id, exc)

    def write(self, document: StoredResponse) -> None:
        """Queue the write of ``document``. Sync, never a checkpoint."""
        self.nursery.start_soon(self._write, document)

    async def _write(self, document: StoredResponse) -> None:
        """Cancellation: abandoned (only when the app's nursery stops): the write is one
        atomic call, so it lands whole or not."""
        try:
            await self.store.put(document)
        except (ResponsesFull, ResponseStoreUnavailable) as exc:
            log.warning("response %s not stored: %s", document.id, exc)


class Recorder:
    """A background stream's observer: the metrics timer and key slot it wraps
    (``inner``), and the final response object written at the stream's last item."""

    def __init__(self, document: StoredResponse, writer: StoreWriter, inner: Any) -> None:
        self._document = document
        self._writer = writer
        self._inner = inner
        # The response object only: its events are encoded for its readers, not here.
        self._events = object_of(document, on_final=self._final)
        self._events.opening()

    def observe(self, item: Any) -> None:
        self._inner.observe(item)
        if not self._events.is_final:
            self._events.encode([item])

    def _final(self, response: dict[str, Any]) -> None:
        self._writer.write(self._document.with_response(response))

    def close(self) -> None:
        self._inner.close()


async def start_background(
    runtime: Runtime, writer: StoreWriter, prepared: Prepared, spec: bytes | None,
    document: StoredResponse, timer: RequestTimer, *, stream: bool,
) -> Response:
    """Open the response's stream in the resume registry (its document is stored,
    ``queued``) and answer: the response object, or (``stream``) its events as its
    first reader.

    Cancellation: before the open, nothing to undo; after it the registry owns the
    stream (and the connection its reader): while the answer waits for a shared store,
    the stream goes on, as a background response does.
    """
    try:
        opened, reader = open_registry_owned(
            runtime, prepared, spec, timer, attach=stream,
            hold_s=runtime.settings.responses_background_s,
            watch=lambda inner: Recorder(document, writer, inner))
    except Exception:  # refused: no response was made
        writer.forget(document)
        raise
    try:
        await wait_stored(runtime, opened.request_id)
    except ApiError:
        writer.forget(document)
        raise
    if reader is None:
        return json_response(document.response,
                             headers={"X-Request-ID": opened.request_id})
    body = EventStreamBody(ResumeSource(reader, runtime.resume_registry()),
                           ReplayedEvents(events_of(document)),
                           keepalive_s=runtime.settings.keepalive_s)
    return sse_response(body, opened.request_id)
