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
               "queued": n, "limit": n, "released": bool[, "text": latest text]}],
     "steps": [[step, ms, rows decoded, prompt positions prefilled, target ms], ...],
     "pool": {"total", "free", "in_use", "cached", "shared"} or null,
     "moments": [{"kind", "id", "key", "detail", "steps", "ms", "count"}]}

Who sees what: an encoder made for a key name (``viewer``) keeps only that key's rows
and moments; the steps and the pool are the server's, without any request in them. An
encoder for every row (``viewer=None``) is for an operator, or a server without keys.
A row's text is there only when the operator's setting put it in the frame.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streams import ScopeFrame

from .encoder import KEEPALIVE_COMMENT
from .native import encode_json_event, error_data

if TYPE_CHECKING:
    from streams import ScopeItem, ScopeMoment, ScopeRow

SHORT_ID = 12  # characters of a request id a row shows
RETRY_MS = 1000  # EventSource's reconnection delay
ALL = None  # the viewer who sees every row


class ScopeEvents:
    """One watcher's events (module docstring).

    Args:
        viewer: the key name whose rows it shows; ``ALL`` (None) for every row.
    """

    def __init__(self, viewer: str | None = ALL) -> None:
        self.viewer = viewer
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
                name = "snapshot" if item.snapshot else "frame"
                out.append(encode_json_event(name, item.event_id, self.frame_data(item)))
            else:  # the watcher's StreamError (it lives beside the stream, with Trio)
                out.append(self.error(item.type, item.message))
        return b"".join(out)

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
        "released": row.released}
    if row.text is not None:
        data["text"] = row.text
    return data


def moment_data(moment: ScopeMoment) -> dict[str, Any]:
    return {"kind": moment.kind,
            "id": None if moment.request_id is None else moment.request_id[:SHORT_ID],
            "key": moment.key, "detail": moment.detail, "steps": moment.steps,
            "ms": moment.ms, "count": moment.count}
