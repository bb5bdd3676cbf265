"""The flood probe: a measurement that needs the server's side of a connection.

Served only by the lab's app (``tools/lab/_app.py``), never by the service. Knows Quart
and Trio, and nothing of the engine or the hub: a probe writes bytes, it does not
generate tokens.

The flood (the buffers experiment, "Where backpressure begins" in the reference chapter)::

    POST /v1/lab/flood {"id": "f1", "event_bytes": 1024,
                        "max_bytes": 67108864, "max_seconds": 60}
    GET  /v1/lab/flood/f1  ->  {"bytes_accepted", "events_accepted", "last_accept_age_s",
                                "blocked", "state", "end", ...}

The POST answers ``text/event-stream`` and writes SSE events of exactly ``event_bytes``
bytes (``data: fff...`` and a blank line) as fast as the connection accepts them. The
client chooses the ``id``, so that a client that reads nothing at all (not even the
response headers) can ask about its flood from another connection.

Theory of operation
-------------------
Quart sends a body as ``async for chunk in body: await send(chunk)``, and hypercorn's
``send`` returns once the socket accepted the bytes (``send_all``; it blocks while the
kernel's buffers are full). So when ``FloodBody.__anext__`` is called again, the chunk
it returned before has been accepted: that call counts it and stamps the time. A chunk
handed out and not accepted for ``BLOCKED_AFTER_S`` means the write is blocked: every
buffer between the server's ``send`` and a reader that does not read is full.
``bytes_accepted`` counts SSE bytes, the body as the application wrote it; hypercorn adds
the chunked framing (a hex length and two CRLFs per write) and the response headers.

Bounds: a flood ends after ``max_bytes`` accepted or ``max_seconds``, checked before each
write. A write that is blocked is not interrupted by either (hypercorn's socket write is
shielded and has no timeout, as for every stream): it ends when its client reads or
goes. When the client goes, hypercorn's blocked write fails (an RST) or the reader sees
EOF, ``http.disconnect`` cancels the request's scope (``app/edge/connection.py``), and the cancel
reaches the flood at its next checkpoint: ``__aexit__`` then ends it (``end``:
``cancelled``) and moves it from the open floods to the recent ones, which GET still
answers (the last ``RECENT_FLOODS``). A flood is registered when Quart enters its body
(``__aenter__``), so one cut off before that (the client left at once) never is: every
registered flood is ended by its ``__aexit__``. Until then GET answers 404.

Cancellation: at ``__anext__``'s one checkpoint, nothing to undo: the previous chunk is
counted before it and the next one handed out only after it, so no count is lost or
doubled. A registered flood is then closed by its owner, the body's ``__aexit__``, which
has no checkpoint and so runs whole in the cancelled scope (``end``: ``cancelled``).
"""

from __future__ import annotations

import enum
import json
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from types import TracebackType

import trio
from pydantic import BaseModel, ConfigDict, Field
from quart import Blueprint, Response
from quart.wrappers.response import ResponseBody

from app.errors import ApiError, ErrorType
from app.routes.serving import read_body, sse_response

# A write handed out this long ago and not accepted is blocked: a loopback write that is
# merely slow (a busy 2-core machine) returns in milliseconds.
BLOCKED_AFTER_S = 0.2
RECENT_FLOODS = 64  # ended floods GET still answers
MIN_EVENT_BYTES = 8  # "data: " and the blank line
MAX_EVENT_BYTES = 1 << 20
MAX_FLOOD_BYTES = 1 << 30
MAX_FLOOD_SECONDS = 600.0


class FloodEnd(enum.Enum):
    """Why a flood stopped writing."""

    MAX_BYTES = "max_bytes"  # it reached max_bytes accepted
    MAX_SECONDS = "max_seconds"  # it ran for max_seconds
    CANCELLED = "cancelled"  # its scope was cancelled: the client left, or the server stops
    ERROR = "error"  # a write raised


class FloodRequest(BaseModel):
    """``{"id", "event_bytes", "max_bytes", "max_seconds"}``; only ``event_bytes`` is
    required."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    id: str = Field(default_factory=lambda: uuid.uuid4().hex, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    event_bytes: int = Field(ge=MIN_EVENT_BYTES, le=MAX_EVENT_BYTES)
    max_bytes: int = Field(default=64 << 20, ge=1, le=MAX_FLOOD_BYTES)
    max_seconds: float = Field(default=60.0, gt=0, le=MAX_FLOOD_SECONDS, allow_inf_nan=False)


@dataclass
class Flood:
    """One flood's counters; times are ``trio.current_time()``."""

    id: str
    event_bytes: int
    max_bytes: int
    max_seconds: float
    started_at: float
    bytes_accepted: int = 0
    events_accepted: int = 0
    last_accept_at: float | None = None
    pending_since: float | None = None  # a write was handed out then and not yet accepted
    end: FloodEnd | None = None
    ended_at: float | None = None

    def status(self, now: float) -> dict[str, object]:
        """What GET answers; ``now`` is ``trio.current_time()``."""
        pending = self.pending_since is not None and self.end is None
        blocked = pending and now - (self.pending_since or now) >= BLOCKED_AFTER_S
        age = None if self.last_accept_at is None else now - self.last_accept_at
        return {
            "id": self.id,
            "event_bytes": self.event_bytes,
            "state": "open" if self.end is None else "ended",
            "end": None if self.end is None else self.end.value,
            "bytes_accepted": self.bytes_accepted,
            "events_accepted": self.events_accepted,
            "bytes_pending": self.event_bytes if pending else 0,
            "last_accept_age_s": None if age is None else round(age, 4),
            "blocked": blocked,
            "elapsed_s": round((self.ended_at or now) - self.started_at, 4),
            # From the first write to the last accepted one: how long the buffers took
            # to fill, for a reader that reads nothing.
            "accepting_s": None if self.last_accept_at is None
            else round(self.last_accept_at - self.started_at, 4),
        }


class FloodRegistry:
    """The open floods and the recently ended ones, for one app."""

    def __init__(self) -> None:
        self.open: dict[str, Flood] = {}
        self.recent: OrderedDict[str, Flood] = OrderedDict()

    def check(self, spec: FloodRequest) -> None:
        """Refuse an id in use (best effort: the flood registers when its body starts).

        Raises:
            ApiError: invalid_request, a flood with this id is open.
        """
        if spec.id in self.open:
            raise ApiError(ErrorType.INVALID_REQUEST, f"a flood with id {spec.id!r} is open")

    def enter(self, flood: Flood) -> None:
        """Register a flood whose body has started writing."""
        self.recent.pop(flood.id, None)
        self.open[flood.id] = flood

    def release(self, flood: Flood) -> None:
        """Move an ended flood to the recent ones. Idempotent."""
        if self.open.get(flood.id) is flood:
            del self.open[flood.id]
            self.recent[flood.id] = flood
            while len(self.recent) > RECENT_FLOODS:
                self.recent.popitem(last=False)

    def find(self, flood_id: str) -> Flood | None:
        return self.open.get(flood_id) or self.recent.get(flood_id)


class FloodBody(ResponseBody):
    """The flood's SSE body (see the module docstring); ``timeout = None`` on its Response."""

    def __init__(self, flood: Flood, registry: FloodRegistry) -> None:
        self.flood = flood
        self.registry = registry
        self.event = b"data: " + b"f" * (flood.event_bytes - MIN_EVENT_BYTES) + b"\n\n"

    async def __aenter__(self) -> FloodBody:
        """Register the flood: only now can it end by ``__aexit__``, so a flood whose
        body never started is never registered. Cancellation: closed by its owner: no
        checkpoint between the registration and the return, and Quart's ``async with``
        runs ``__aexit__`` on every way out once this returned."""
        self.flood.started_at = trio.current_time()
        self.registry.enter(self.flood)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """End and release the flood, on every way out. Cancellation: closed by its
        owner: this is the owner's close, with no checkpoint, so it runs whole in a
        cancelled scope."""
        flood = self.flood
        if flood.end is None:
            cancelled = exc_type is not None and issubclass(exc_type, trio.Cancelled)
            flood.end = FloodEnd.CANCELLED if cancelled or exc_type is None else FloodEnd.ERROR
            flood.ended_at = trio.current_time()
        self.registry.release(flood)

    def __aiter__(self) -> FloodBody:
        return self

    async def __anext__(self) -> bytes:
        """Count the previous chunk as accepted; the next chunk, unless a bound is reached.

        Raises:
            StopAsyncIteration: ``max_bytes`` or ``max_seconds`` reached.

        Cancellation: nothing to undo, at the checkpoint before the chunk is handed out
        (the previous one counted already); ``__aexit__`` then ends the flood.
        """
        flood = self.flood
        now = trio.current_time()
        if flood.pending_since is not None:
            flood.bytes_accepted += flood.event_bytes
            flood.events_accepted += 1
            flood.last_accept_at, flood.pending_since = now, None
        if flood.bytes_accepted + flood.event_bytes > flood.max_bytes:
            self._end(FloodEnd.MAX_BYTES, now)
        if now - flood.started_at >= flood.max_seconds:
            self._end(FloodEnd.MAX_SECONDS, now)
        # A write to a fast reader may never block; this lets a cancel (the client left)
        # reach the flood anyway.
        await trio.lowlevel.checkpoint()
        flood.pending_since = trio.current_time()
        return self.event

    def _end(self, end: FloodEnd, now: float) -> None:
        self.flood.end, self.flood.ended_at = end, now
        raise StopAsyncIteration


def make_flood_blueprint() -> Blueprint:
    """The flood's routes, with their own registry of floods."""
    bp = Blueprint("streamscope_lab_flood", __name__)
    floods = FloodRegistry()

    @bp.post("/v1/lab/flood")
    async def flood() -> Response:
        """Start a flood and answer it as ``text/event-stream``.

        Raises: pydantic.ValidationError (422), ApiError for an id in use (422).
        Cancellation: before the body starts, nothing to undo: nothing is registered
        (reading the request, or a body Quart never entered). After, the flood is
        closed by its owner, the body's ``__aexit__``.
        """
        spec = FloodRequest.model_validate_json(await read_body())
        floods.check(spec)
        flood = Flood(spec.id, spec.event_bytes, spec.max_bytes, spec.max_seconds,
                      started_at=trio.current_time())
        body = FloodBody(flood, floods)
        return sse_response(body, None, headers={"X-Flood-ID": spec.id})  # max_seconds bounds it

    @bp.get("/v1/lab/flood/<flood_id>")
    async def flood_status(flood_id: str) -> Response:
        """A flood's counters (see the module docstring), or 404. Cancellation: nothing
        to undo: a read, with no checkpoint."""
        found = floods.find(flood_id)
        if found is None:
            raise ApiError(ErrorType.NOT_FOUND, f"no flood {flood_id[:64]!r}")
        return Response(json.dumps(found.status(trio.current_time())), status=200,
                        content_type="application/json")

    return bp
