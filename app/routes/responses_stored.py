"""Stored responses: ``GET /v1/responses/<id>`` (with ``?stream=true&starting_after=N``
for a background one), ``GET .../input_items``, ``DELETE``, ``POST .../cancel``, and the
conversation a ``previous_response_id`` continues.

Every id is bound to the API key that made it (its request id carries the key's tag,
``app.auth.may_see``): another key's id is answered 404, exactly as an unknown one. A
response is read from the response store (``app.runtime.responses_store``); a background
one not final there yet is read from its stream's log (``ResumeRegistry.logged``, on
any replica with a shared store), its events made again (``responses_replay``), and its
final object written back once the log shows it ended.
"""

from __future__ import annotations

from typing import Any

import trio
from quart import Response, request

from streams.resume import (
    BadPosition,
    Draining,
    NothingToResume,
    ReaderBusy,
    StoreRejected,
    StoreUnavailable,
)

from ..auth import may_see
from ..edge.connection import close_with_connection
from ..errors import ApiError, ErrorType
from ..runtime import (
    SHUTDOWN_RETRY_AFTER_S,
    ResponseStore,
    ResponseStoreUnavailable,
    Runtime,
    StoredResponse,
)
from ..wire import RETRY_MS, ReplayedEvents, replay
from .body import EventStreamBody
from .responses_background import StoreWriter
from .responses_objects import FINAL, events_of, not_found, object_of, request_id_of
from .resume_source import ResumeSource
from .serving import json_response, sse_response

# A next turn may arrive before its previous foreground response's final document is
# written (it is written as its last event goes out): it waits this long for it.
SETTLE_WAIT_S = 2.0
SETTLE_POLL_S = 0.02
MAX_LIST_LIMIT = 100


def unavailable() -> ApiError:
    return ApiError(ErrorType.UNAVAILABLE, "the shared store does not answer; try again",
                    retry_after_s=RETRY_MS / 1000)


class StoredResponses:
    """The stored-response views, bound to one app's runtime, store and writer."""

    def __init__(self, runtime: Runtime, store: ResponseStore, writer: StoreWriter) -> None:
        self.runtime = runtime
        self.store = store
        self.writer = writer

    async def document(self, response_id: str) -> StoredResponse:
        """The stored record of one of this key's responses.

        Raises: ApiError 404 (unknown, expired, another key's), 503 (store away).
        Cancellation: nothing to undo: a read of the store, abandoned to its thread with
        a shared store.
        """
        request_id = request_id_of(response_id)
        if not may_see(request_id):
            raise not_found(response_id)
        try:
            document = await self.store.get(response_id)
        except ResponseStoreUnavailable:
            raise unavailable() from None
        if document is None:
            raise not_found(response_id)
        return document

    async def current(self, document: StoredResponse) -> dict[str, Any]:
        """The response object now: as stored, or for a background one not final there,
        as its stream's log says (written back once final).

        Cancellation: nothing to undo: reads only; the final object it may find is
        written in the app's nursery (``StoreWriter.write``, sync), which no request's
        cancel reaches.
        """
        response = document.response
        if response["status"] in FINAL or not document.is_background:
            return response
        try:
            logged = await self.runtime.resume_registry().logged(request_id_of(response["id"]))
        except (StoreUnavailable, StoreRejected):
            raise unavailable() from None
        if logged is None:  # its log expired before its end was written: it is lost
            return {**response, "status": "failed",
                    "error": {"code": "expired", "message": "the response's stream ended "
                              "without a final state (its server stopped)"}}
        events = object_of(document)  # the object only: these events go to nobody
        replay(events, logged)
        if events.is_final:
            self.writer.write(document.with_response(events.response))
        elif len(logged) > 1:
            events.response["status"] = "in_progress"
        else:
            events.response["status"] = "queued"
        return events.response

    async def previous(self, response_id: str) -> list[dict[str, Any]]:
        """The items a ``previous_response_id`` continues: the previous response's
        context and output. A foreground response still being written is waited for
        (``SETTLE_WAIT_S``); a background one still running is refused.

        Raises: ApiError 404 (param ``previous_response_id``), 400 (not final).
        Cancellation: nothing to undo: it lands at the store's reads or the waits between
        them, before the request's stream is opened.
        """
        document = await self.document(response_id)
        response = await self.current(document)
        with trio.move_on_after(SETTLE_WAIT_S):
            while response["status"] not in FINAL and not response["background"]:
                await trio.sleep(SETTLE_POLL_S)
                document = await self.document(response_id)
                response = await self.current(document)
        if response["status"] not in FINAL:
            raise ApiError(ErrorType.BAD_REQUEST, f"the previous response {response_id!r} is "
                           f"{response['status']}: continue it once it has ended")
        return [*document.context, *response["output"]]

    async def retrieve(self, response_id: str) -> Response:
        """The response object, or (``?stream=true``) a background response's events after
        ``starting_after``, then live. Cancellation: nothing to undo while it reads the
        store; then ``stream_events``'s (the stream is handed over, never cancelled)."""
        document = await self.document(response_id)
        if request.args.get("stream", "false").lower() == "true":
            return await self.stream_events(document)
        return json_response(await self.current(document))

    async def stream_events(self, document: StoredResponse) -> Response:
        """Attach to the background response's stream (any replica) and send its events
        after ``starting_after``.

        Cancellation: handed over: the stream is the registry's throughout. While
        attaching, ``ResumeRegistry.attach`` finishes its hand-over first (shielded, one
        scheduling round); after, the connection owns the reader, whose close hands the
        stream back.
        """
        if not document.is_background:
            raise ApiError(ErrorType.BAD_REQUEST, "only a background response can be "
                           "streamed again; GET it without stream")
        after = _starting_after(request.args.get("starting_after"))
        registry = self.runtime.resume_registry()
        request_id = request_id_of(document.id)
        try:
            reader = await registry.attach(request_id, 0)
        except NothingToResume:
            raise ApiError(ErrorType.NOT_FOUND, "the response's events are no longer held "
                           "(they are kept STREAMSCOPE_RESUME_GRACE_S after its end); GET "
                           "it without stream") from None
        except (ReaderBusy, BadPosition) as exc:
            raise ApiError(ErrorType.STREAM_BUSY, f"{exc}; try again") from None
        except StoreUnavailable:
            raise unavailable() from None
        except Draining:
            raise ApiError(ErrorType.SHUTDOWN, "this replica is stopping: read the response "
                           "on another", retry_after_s=SHUTDOWN_RETRY_AFTER_S) from None
        close_with_connection(request.scope, reader)
        body = EventStreamBody(ResumeSource(reader, registry),
                               ReplayedEvents(events_of(document, skip_through=after)),
                               keepalive_s=self.runtime.settings.keepalive_s)
        return sse_response(body, request_id)

    async def input_items(self, response_id: str) -> Response:
        """OpenAI's list of the response's input items (``order``, ``limit``, ``after``,
        ``before``). Cancellation: nothing to undo: a read."""
        items = list((await self.document(response_id)).input_items)
        args = request.args
        if args.get("order", "desc") == "desc":
            items.reverse()
        for name in ("after", "before"):
            given = args.get(name)
            if given is not None:
                ids = [item["id"] for item in items]
                if given not in ids:
                    raise ApiError(ErrorType.INVALID_REQUEST, f"{name}: no item {given!r}")
                at = ids.index(given)
                items = items[at + 1:] if name == "after" else items[:at]
        limit = _limit(args.get("limit"))
        page = items[:limit]
        return json_response({"object": "list", "data": page,
                              "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None,
                              "has_more": len(items) > limit})

    async def delete(self, response_id: str) -> Response:
        """Forget a stored response (a background one still running is cancelled too).
        Cancellation: abandoned at the store's calls (each one atomic: it lands whole or
        not); a delete asked again is idempotent."""
        document = await self.document(response_id)
        if document.is_background:
            await self._cancel_stream(document)
        try:
            await self.store.delete(document.owner, response_id)
        except ResponseStoreUnavailable:
            raise unavailable() from None
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str) -> Response:
        """Cancel a background response: its stream ends (its blocks come back at the
        next step) and its object says ``cancelled``; one already over is answered as
        it is (idempotent). Cancellation: abandoned at the store's calls (each atomic: it
        lands whole or not); asked again, the cancel is idempotent."""
        document = await self.document(response_id)
        response = await self.current(document)
        if not response["background"]:
            raise ApiError(ErrorType.BAD_REQUEST, "only a background response can be "
                           "cancelled")
        if response["status"] in FINAL:
            return json_response(response)
        await self._cancel_stream(document)
        cancelled = {**response, "status": "cancelled"}
        try:
            await self.store.put(document.with_response(cancelled))
        except ResponseStoreUnavailable:
            raise unavailable() from None
        return json_response(cancelled)

    async def _cancel_stream(self, document: StoredResponse) -> None:
        """Cancellation: abandoned at the ask of the shared store (one atomic script:
        it lands whole or not); a local stream is closed before any checkpoint."""
        request_id = request_id_of(document.id)
        try:
            await self.runtime.resume_registry().cancel_anywhere(request_id)
        except StoreUnavailable:
            raise unavailable() from None


def _starting_after(value: str | None) -> int:
    if value is None:
        return -1
    if not (value.isascii() and value.isdigit()) or len(value) > 9:
        raise ApiError(ErrorType.INVALID_REQUEST, "starting_after must be a sequence number")
    return int(value)


def _limit(value: str | None) -> int:
    if value is None:
        return 20
    # the length first: ``int`` of thousands of digits raises (Python's int max str digits)
    if not (value.isascii() and value.isdigit()) or len(value) > len(str(MAX_LIST_LIMIT)) \
            or not 1 <= int(value) <= MAX_LIST_LIMIT:
        raise ApiError(ErrorType.INVALID_REQUEST, f"limit must be 1 to {MAX_LIST_LIMIT}")
    return int(value)
