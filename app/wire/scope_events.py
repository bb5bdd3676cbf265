"""``/scope/events``: the scope's frames as SSE events for one watcher, sans-IO.

Events (data: compact JSON escaped to ASCII; ids are the feed's, ``<epoch>-<n>``, so
a page that reconnects sends the last one as ``Last-Event-ID`` and the feed replays
what it missed, or starts it again from a snapshot)::

    snapshot  a frame holding all there is to know now: first, and after the watcher
              missed frames (``missed``: how many its full queue dropped, in all)
    frame     what changed at a step boundary
    error     {"error": {"type": "slow_client"|..., "message": ...}}: last

A frame's data::

    {"t": server time s, "missed": n,
     "rows": [{"id": short id, "key": key name or null, "state": ..., "tokens": n,
               "queued": n, "limit": n, "released": bool, "band": its priority
               band[, "text": latest text]}],
     "steps": [[step, ms, rows decoded, prompt positions prefilled, target ms], ...],
     "pool": {"total", "free", "in_use", "cached", "shared"} or null,
     "moments": [{"kind", "id", "key", "detail", "steps", "ms", "count"}]}

Who sees what: an encoder made for a key name (``viewer``) keeps only that key's rows
and moments; the steps and the pool are the server's, without any request in them. An
encoder for every row (``viewer=None``) is for an operator, or a server without keys.
A row's text is there only when the operator's setting put it in the frame.

One encode per frame and view, not per watcher (``SharedFrames``): every watcher gets
the same live frame object from the feed, and the watchers of one view (the same key
name, or ``ALL``) get the same bytes, so the first of them to write the frame encodes
it and the others reuse its bytes. A key sees only its own rows, so bytes are never
shared across views. Snapshots are made for one watcher (``missed`` is its own) and
encoded by it alone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from streams import ScopeFrame

from .encoder import KEEPALIVE_COMMENT
from .native import encode_json_event, error_data

if TYPE_CHECKING:
    from streams import ScopeItem, ScopeMoment, ScopeRow

SHORT_ID = 12  # characters of a request id a row shows
RETRY_MS = 1000  # EventSource's reconnection delay
ALL = None  # the viewer who sees every row


SHARED_FRAMES = 32  # the latest live frames whose bytes are kept, per view


class SharedFrames:
    """The event bytes of the latest live frames, per view, made once and shared by
    every watcher of that view (module docstring). One per app; the Trio thread only.

    A watcher more than ``keep`` frames behind finds its frame's bytes gone and encodes
    them again (the same bytes): the cache is bounded, and only costs time then.
    """

    def __init__(self, keep: int = SHARED_FRAMES) -> None:
        self._keep = keep
        self._events: OrderedDict[str, dict[str | None, bytes]] = OrderedDict()

    def event(self, frame: ScopeFrame, viewer: str | None,
              encode: Callable[[ScopeFrame], bytes]) -> bytes:
        """``frame``'s event for ``viewer``: the bytes made before, or
        ``encode(frame)``'s."""
        views = self._events.get(frame.event_id)
        if views is None:
            views = self._events[frame.event_id] = {}
            while len(self._events) > self._keep:
                self._events.popitem(last=False)
        data = views.get(viewer)
        if data is None:
            data = views[viewer] = encode(frame)
        return data


class ScopeEvents:
    """One watcher's events (module docstring).

    Args:
        viewer: the key name whose rows it shows; ``ALL`` (None) for every row.
        shared: the app's ``SharedFrames``, whose bytes every watcher of a view shares;
            None: this watcher encodes each frame itself.
    """

    def __init__(self, viewer: str | None = ALL, shared: SharedFrames | None = None) -> None:
        self.viewer = viewer
        self.shared = shared
        self._last_id = ""

    def opening(self) -> bytes:
        """The reconnection delay, before any event (no event is dispatched)."""
        return f"retry: {RETRY_MS}\n\n".encode("ascii")

    def encode(self, items: list[ScopeItem]) -> bytes:
        """Each frame its own event; an error (``StreamError``) is the last."""
        out = []
        for item in items:
            if isinstance(item, ScopeFrame):
                self._last_id = item.event_id
                if item.snapshot or self.shared is None:
                    out.append(self.frame_event(item))
                else:
                    out.append(self.shared.event(item, self.viewer, self.frame_event))
            else:  # the watcher's StreamError (it lives beside the stream, with Trio)
                out.append(self.error(item.type, item.message))
        return b"".join(out)

    def frame_event(self, frame: ScopeFrame) -> bytes:
        """``frame`` as one event of this viewer's (its JSON encoded here)."""
        name = "snapshot" if frame.snapshot else "frame"
        return encode_json_event(name, frame.event_id, self.frame_data(frame))

    def error(self, error_type: Any, message: str) -> bytes:
        """The last event: the watcher was dropped, or the server stops."""
        kind = getattr(error_type, "value", error_type)
        return encode_json_event("error", self._last_id, error_data(kind, message))

    def keepalive(self) -> bytes:
        return KEEPALIVE_COMMENT

    def frame_data(self, frame: ScopeFrame) -> dict[str, Any]:
        """A frame's data as this viewer may see it."""
        pool = frame.pool
        return {
            "t": round(frame.time_s, 6),
            "missed": frame.missed,
            "rows": [row_data(r) for r in frame.rows if self.sees(r.key)],
            "steps": [[s.step, s.ms if s.ms is None else round(s.ms, 3), s.decoded,
                       s.prefilled, s.target_ms] for s in frame.steps],
            "pool": None if pool is None else {
                "total": pool.total, "free": pool.free, "in_use": pool.in_use,
                "cached": pool.cached, "shared": pool.shared},
            "moments": [moment_data(m) for m in frame.moments
                        if m.request_id is None or self.sees(m.key)],
        }

    def sees(self, key: str | None) -> bool:
        return self.viewer is ALL or key == self.viewer


def row_data(row: ScopeRow) -> dict[str, Any]:
    data: dict[str, Any] = {
        "id": row.request_id[:SHORT_ID], "key": row.key, "state": row.state,
        "tokens": row.tokens, "queued": row.queued, "limit": row.queue_limit,
        "released": row.released, "band": row.band}
    if row.text is not None:
        data["text"] = row.text
    return data


def moment_data(moment: ScopeMoment) -> dict[str, Any]:
    return {"kind": moment.kind,
            "id": None if moment.request_id is None else moment.request_id[:SHORT_ID],
            "key": moment.key, "detail": moment.detail, "steps": moment.steps,
            "ms": moment.ms, "count": moment.count}
