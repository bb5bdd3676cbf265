"""The hub's open streams, and the hub as each of them sees it (``StreamControl``).

A ``TokenStream`` asks the hub for engine wishes (pause, resume, cancel), a stall
watch, and the *writing* marks that let the stepping thread coalesce (``stepper.py``),
and it unregisters itself when it closes. ``OpenStreams`` answers those calls, keeps
the registry of open streams they change, and nothing else: the hub reads it between
steps. Every call is sync and never a checkpoint (a stream makes them from ``close``,
which runs in cancelled scopes and ``finally`` blocks).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from .hub_types import StepEngine
from .stream import StreamState, TokenStream


class OpenStreams:
    """The streams the hub registered and has not seen close (see the module docstring).

    Args:
        engine: where the wishes go.

    Whom it tells of what its streams do is set by ``connect``: those parts (the step
    loop, the stepper, the scope) are made after it, since they read it.
    """

    def __init__(self, engine: StepEngine) -> None:
        self._engine = engine
        self._wake: Callable[[], None] = _nobody
        self._caught_up: Callable[[], None] = _nobody
        self._closed: Callable[[TokenStream], None] = _nobody
        self._streams: dict[str, TokenStream] = {}
        self._writing: set[str] = set()  # streams whose reader has items to write
        self.closes = 0  # close() calls that did work (one per stream)
        # The stall watchdog's scope (``Hub._watch_stalls``), while it sleeps.
        self.watch_scope: trio.CancelScope | None = None

    def connect(self, *, wake: Callable[[], None], caught_up: Callable[[], None],
                closed: Callable[[TokenStream], None]) -> None:
        """Whom to tell: ``wake`` wakes the hub's step loop (a wish gives it work);
        ``caught_up`` is told when no stream has items left to write (the stepping
        thread may route what it held for them); ``closed`` is told of each stream as
        it unregisters (the hub's scope)."""
        self._wake, self._caught_up, self._closed = wake, caught_up, closed

    # -- the hub's side ------------------------------------------------------------

    def add(self, stream: TokenStream) -> None:
        self._streams[stream.request_id] = stream

    def get(self, request_id: str) -> TokenStream | None:
        return self._streams.get(request_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def all(self) -> list[TokenStream]:
        return list(self._streams.values())

    def any_writing(self) -> bool:
        """Whether a stream's writer still has items to write (the stepper's ``hold``)."""
        return bool(self._writing)

    def num_waiting(self) -> int:
        return sum(s.state is StreamState.WAITING for s in self._streams.values())

    def earliest_stall(self) -> float:
        deadlines = (s.statistics().stall_deadline for s in self._streams.values())
        return min((d for d in deadlines if d is not None), default=math.inf)

    # -- StreamControl: the streams' side ---------------------------------------------

    def pause(self, request_id: str) -> None:
        self._engine.pause(request_id)

    def resume(self, request_id: str) -> None:
        self._engine.resume(request_id)
        self._wake()

    def cancel(self, request_id: str) -> None:
        self._engine.cancel(request_id)
        self._wake()

    def watch(self, deadline: float) -> None:
        scope = self.watch_scope
        if scope is not None and deadline < scope.deadline:
            scope.deadline = deadline

    def writing(self, stream: TokenStream) -> None:
        self._writing.add(stream.request_id)

    def written(self, stream: TokenStream) -> None:
        self._writing.discard(stream.request_id)
        if not self._writing:  # the loop caught up: route what was held for it
            self._caught_up()

    def unregister(self, stream: TokenStream) -> None:
        del self._streams[stream.request_id]
        self.closes += 1
        self._closed(stream)


def _nobody(*_: object) -> None:
    """Told nothing: an ``OpenStreams`` not connected yet (``tools/scopebench.py``'s)."""
