"""Where a step's events go, and the hub's ledger of what the engine holds.

Each event goes to its stream (``TokenStream.deliver``, through the stream's policy,
synchronously: routing never waits for a reader); an event for a stream that is closed or
has ended is dropped and counted. The ledger is every request id submitted through the
hub whose ``FinishEvent`` has not arrived yet (``in_engine``): while it is not empty the
engine's cache is not whole, and the hub's drain steps on until it is. The engine sends
exactly one ``FinishEvent`` per request (finished, failed or cancelled), so each id
leaves the ledger once; the last ``RECENT_FINISHES`` of them are kept for
``Hub.finished``. Trio thread only (the stepper routes there); sync, no checkpoint.
"""

from __future__ import annotations

from collections import OrderedDict

from engine import EngineEvent, FinishEvent

from .deadlines import TtftDeadlines
from .open_streams import OpenStreams

# How many engine finishes are remembered: enough for the reference chapter's 300-stream
# leak test and for looking up a request a client just ran.
RECENT_FINISHES = 4096


class EventRouter:
    """Routes the engine's events to the open streams; keeps the ledger (see above)."""

    def __init__(self, streams: OpenStreams, deadlines: TtftDeadlines) -> None:
        self._streams = streams
        self._deadlines = deadlines
        self.in_engine: set[str] = set()
        self.routed = self.dropped = 0
        self._recent: OrderedDict[str, FinishEvent] = OrderedDict()

    def submitted(self, request_id: str) -> None:
        """The engine accepted ``request_id``: it is in the ledger until its finish."""
        self.in_engine.add(request_id)

    def route(self, events: list[EngineEvent]) -> None:
        """Deliver each event to its stream, in order; a finish leaves the ledger."""
        for event in events:
            if isinstance(event, FinishEvent):
                self.in_engine.discard(event.request_id)
                self._deadlines.finished(event)
                self._recent[event.request_id] = event
                if len(self._recent) > RECENT_FINISHES:
                    self._recent.popitem(last=False)
            stream = self._streams.get(event.request_id)
            if stream is not None and stream.deliver(event):
                self.routed += 1
            else:
                self.dropped += 1

    def finished(self, request_id: str) -> FinishEvent | None:
        """The engine's FinishEvent for a recent request, if it is remembered."""
        return self._recent.get(request_id)
