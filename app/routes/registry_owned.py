"""The one opener of registry-owned streams: ``POST /v1/requests``, ``POST /v1/stream``
with ``resumable``, and background responses (``responses_background.py``).

Such a stream belongs to the resume registry from the moment it opens (``ResumeRegistry
.adopt``, right after ``Runtime.open``, no checkpoint between): the registry logs its
items (memory, or the shared Redis with its failover), holds it with no reader, counts
it against ``max_detached_streams`` and, with API keys, against its key's fair share of
that cap (``app.key_shares``: the stream is opened ``resumable``) and its key's
``max_streams``, until it ends. A request's connection owns only the stream's first
reader (``attach``), whose ``close()`` hands the stream back to the registry when the
response ends, however it ends; ``streams.resume`` tells the hand-over and what happens
when nobody comes back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import trio
from quart import request

from streams import StreamItem, TokenStream
from streams.resume import Reader, ResumeRegistry, StoreUnavailable

from ..auth import SlotObserver, observer
from ..edge.connection import close_with_connection
from ..errors import ApiError, ErrorType
from ..metrics import RequestTimer
from ..runtime import Prepared, Runtime
from ..wire import RETRY_MS, ResumableEvents

# With a shared store, how long a request waits for its new stream to be in it before
# answering (a write takes milliseconds; a store away that long: 503).
STORED_WAIT_S = 2.0



class Watching(Protocol):
    """What the registry tells of the stream (``streams.resume``'s observer): the
    request's timer holding its key's slot (``auth.observer``), or something that wraps
    it (a background response's recorder)."""

    def observe(self, item: StreamItem) -> None: ...

    def close(self) -> None: ...


def resume_url(request_id: str) -> str:
    return f"/v1/stream/{request_id}"


def check_detached(runtime: Runtime, registry: ResumeRegistry) -> None:
    """Refuse a new resumable stream while ``max_detached_streams`` generate with no
    reader (each may become one). Sync: call it right before the open.

    Raises: ApiError 429 too_many_detached (``Retry-After``: the attach timeout, within
    which a created stream nobody reads ends).
    """
    settings = runtime.settings
    if registry.generating_detached() >= settings.max_detached_streams:
        raise ApiError(ErrorType.TOO_MANY_DETACHED,
                       f"{settings.max_detached_streams} resumable streams generate with no "
                       f"reader, this server's limit; try again later",
                       retry_after_s=settings.attach_timeout_s)


def open_registry_owned(
    runtime: Runtime, prepared: Prepared, spec: bytes | None, timer: RequestTimer, *,
    attach: bool, attach_within_s: float | None = None, hold_s: float | None = None,
    watch: Callable[[RequestTimer | SlotObserver], Watching] | None = None,
) -> tuple[TokenStream, Reader | None]:
    """Open a prepared request in the resume registry: the registry takes the stream
    just opened (``Runtime.open(resumable=True)``), and its timer (closed when the
    registry forgets the stream) with the request's slot of its API key
    (``auth.observer``, wrapped by ``watch`` if given); with ``attach``, the request's
    connection owns its first reader, else a reader must come within
    ``attach_within_s``. ``hold_s``: how long it generates with no reader (the
    registry's grace period if None). ``spec``: its failover spec with a shared store.

    Sync, never a checkpoint: nothing can cancel between the open and the registry
    taking the stream.

    Raises: ApiError 429 too_many_detached (nothing opened); what ``Runtime.open``
    raises (nothing submitted); RuntimeError, the registry not running (the stream is
    closed).
    """
    registry = runtime.resume_registry()
    check_detached(runtime, registry)
    # resumable: the key's share of max_detached_streams is checked and counted, as for
    # the registry's other streams (key_shares.py); else one key's background responses
    # could take every place of the cap from the other keys.
    stream = runtime.open(prepared, resumable=True)
    timer.submitted(stream.prompt_tokens, stream.request_id, prepared.request.max_new_tokens)
    events = ResumableEvents(stream.request_id, stream.prompt_tokens)
    watcher = observer(timer)
    watching: Watching = watcher if watch is None else watch(watcher)
    try:
        reader = registry.adopt(stream, events, events.opening(), observer=watching,
                                attach=attach, spec=spec, attach_within_s=attach_within_s,
                                hold_s=hold_s)
    except RuntimeError:  # not running (the stream is closed): nobody else closes watcher
        watcher.close()
        raise
    if reader is not None:
        close_with_connection(request.scope, reader)
    return stream, reader


async def wait_stored(runtime: Runtime, request_id: str) -> None:
    """With a shared store, return once the stream just opened is in it (spec, owner
    lease, event 1), so that a resume on any replica finds it: a 201 promises that (a
    replica that does not know the stream answers 204, and an EventSource stops). A
    store that does not take it within ``STORED_WAIT_S``: the stream is cancelled and
    the request refused with 503 ``unavailable`` (``Retry-After``), as a resume of
    another replica's stream is then. Without a shared store, at once.

    Raises: ApiError 503. Cancellation: handed over: the registry holds the stream (its
    grace period runs, or a background response goes on), as when a client leaves
    right after its answer; the wait itself only waits.
    """
    registry = runtime.resume_registry()
    with trio.move_on_after(STORED_WAIT_S):
        try:
            await registry.stored()
            return
        except StoreUnavailable:
            pass
    registry.cancel(request_id)
    raise ApiError(ErrorType.UNAVAILABLE, "the shared stream log does not answer; try again",
                   retry_after_s=RETRY_MS / 1000)
