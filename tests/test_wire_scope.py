"""The scope's encoder (``app.wire.ScopeEvents``), sans-IO: frames to SSE events, what
each viewer may see, no text unless the frame carries it, the last error event."""

from __future__ import annotations

import json

from app.wire import ScopeEvents, SharedFrames
from app.wire.scope_events import SHORT_ID
from streams import (
    ErrorType,
    ScopeFrame,
    ScopeMoment,
    ScopePool,
    ScopeRow,
    ScopeStep,
    SSEParser,
    StreamError,
)

ALICE_ID = "a1" * 16
BOB_ID = "b2" * 16


def frame(*, snapshot: bool = False, text: str | None = None, seq: int = 7) -> ScopeFrame:
    rows = (ScopeRow(ALICE_ID, "alice", "running", 5, 2, 32, text=text),
            ScopeRow(BOB_ID, "bob", "cancelled", 9, 0, 32, released=True, band=-2))
    moments = (ScopeMoment("disconnect", BOB_ID, "bob", "the client left", steps=1, ms=4.5),
               ScopeMoment("preemption", None, None, "blocks taken back", count=2))
    return ScopeFrame(f"e0-{seq}", 12.5, snapshot, rows,
                      (ScopeStep(41, 3.25, 2, 0, None), ScopeStep(42, 9.0, 1, 16, 8.0)),
                      ScopePool(total=64, free=50, in_use=14, cached=6, shared=2), moments,
                      missed=3 if snapshot else 0)


def parse(data: bytes) -> list[tuple[str, str, dict]]:
    events = SSEParser().feed(data)
    return [(e.event, e.id, json.loads(e.data)) for e in events]


def test_a_frame_is_one_event_with_the_feeds_id_and_every_part() -> None:
    [(name, event_id, data)] = parse(ScopeEvents().encode([frame()]))
    assert (name, event_id) == ("frame", "e0-7")
    assert data["rows"] == [
        {"id": ALICE_ID[:SHORT_ID], "key": "alice", "state": "running", "tokens": 5,
         "queued": 2, "limit": 32, "released": False, "band": 0},
        {"id": BOB_ID[:SHORT_ID], "key": "bob", "state": "cancelled", "tokens": 9,
         "queued": 0, "limit": 32, "released": True, "band": -2}]
    assert data["steps"] == [[41, 3.25, 2, 0, None], [42, 9.0, 1, 16, 8.0]]
    assert data["pool"] == {"total": 64, "free": 50, "in_use": 14, "cached": 6, "shared": 2}
    assert [m["kind"] for m in data["moments"]] == ["disconnect", "preemption"]
    assert data["moments"][0] == {"kind": "disconnect", "id": BOB_ID[:SHORT_ID],
                                  "key": "bob", "detail": "the client left", "steps": 1,
                                  "ms": 4.5, "count": None}
    assert (data["t"], data["missed"]) == (12.5, 0)


def test_a_snapshot_is_named_so_and_says_what_was_missed() -> None:
    [(name, event_id, data)] = parse(ScopeEvents().encode([frame(snapshot=True)]))
    assert (name, event_id, data["missed"]) == ("snapshot", "e0-7", 3)


def test_a_key_holder_sees_only_its_own_rows_and_moments_and_the_servers_steps() -> None:
    [(_, _, data)] = parse(ScopeEvents("alice").encode([frame()]))
    assert [r["key"] for r in data["rows"]] == ["alice"]
    assert [m["kind"] for m in data["moments"]] == ["preemption"]  # no request in it
    assert len(data["steps"]) == 2 and data["pool"]["total"] == 64


def test_no_text_unless_the_frame_carries_it() -> None:
    [(_, _, plain)] = parse(ScopeEvents().encode([frame()]))
    assert all("text" not in r for r in plain["rows"])
    [(_, _, shown)] = parse(ScopeEvents().encode([frame(text="Paris\u2028is")]))
    assert shown["rows"][0]["text"] == "Paris\u2028is"


def test_several_frames_are_several_events_and_an_error_ends_with_the_last_id() -> None:
    encoder = ScopeEvents()
    error = StreamError(ErrorType.SLOW_CLIENT, "the scope's reader stayed behind")
    events = parse(encoder.encode([frame(seq=1), frame(seq=2), error]))
    assert [(n, i) for n, i, _ in events] == [("frame", "e0-1"), ("frame", "e0-2"),
                                              ("error", "e0-2")]
    assert events[2][2] == {"error": {"type": "slow_client",
                                      "message": "the scope's reader stayed behind"}}


def test_the_opening_sets_the_retry_and_dispatches_nothing() -> None:
    parser = SSEParser()
    assert parser.feed(ScopeEvents().opening()) == []
    assert parser.retry == 1000
    assert ScopeEvents().keepalive().startswith(b":")


class CountingEvents(ScopeEvents):
    """An encoder that counts the frames it turns into JSON itself (``frame_data``)."""

    def __init__(self, viewer: str | None, shared: SharedFrames | None,
                 counts: dict[str | None, int]) -> None:
        super().__init__(viewer, shared)
        self.counts = counts

    def frame_data(self, frame: ScopeFrame) -> dict:
        self.counts[self.viewer] = self.counts.get(self.viewer, 0) + 1
        return super().frame_data(frame)


def test_a_frame_is_encoded_once_per_view_for_any_number_of_watchers() -> None:
    """Issue 43, item 5: each watcher encoded each frame itself (30 µs of the loop a
    watcher and step); now the watchers of one view share one encode's bytes, and a
    key's bytes are never another view's."""
    shared, counts = SharedFrames(), dict[str | None, int]()
    views = ["alice"] * 10 + [None] * 5 + ["bob"] * 3
    watchers = [CountingEvents(v, shared, counts) for v in views]
    live = frame()
    out = {v: {w.encode([live]) for w in watchers if w.viewer == v} for v in set(views)}
    again = CountingEvents("alice", shared, counts).encode([live])  # a late watcher

    assert counts == {"alice": 1, None: 1, "bob": 1}
    assert all(len(data) == 1 for data in out.values())  # one view: the same bytes
    assert {again} == out["alice"]
    assert [r["key"] for r in parse(again)[0][2]["rows"]] == ["alice"]
    assert [r["key"] for r in parse(next(iter(out[None])))[0][2]["rows"]] == ["alice", "bob"]
    # a snapshot is one watcher's own (its missed count): encoded by each
    for watcher in watchers[:3]:
        watcher.encode([frame(snapshot=True)])
    assert counts["alice"] == 4


def test_the_shared_bytes_are_bounded_to_the_latest_frames() -> None:
    shared, counts = SharedFrames(keep=2), dict[str | None, int]()
    first, second = CountingEvents("alice", shared, counts), CountingEvents("alice", shared,
                                                                            counts)
    for seq in range(5):
        first.encode([frame(seq=seq)])
    second.encode([frame(seq=0)])  # fell off: encoded again, the same bytes
    second.encode([frame(seq=4)])  # still there

    assert counts["alice"] == 6
    assert second.encode([frame(seq=0)]) == first.encode([frame(seq=0)])
