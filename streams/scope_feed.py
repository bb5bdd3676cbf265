"""The scope's feed: what happens at each step boundary, built only while someone watches.

The hub holds one ``ScopeFeed`` (``Hub.scope``); ``app.routes.scope`` subscribes
watchers (``scope_watcher.py``) and ``app.wire.scope_events`` turns frames into SSE.

Theory of operation
-------------------
Three hooks feed it, each behind one attribute check (``watched``), so that with no
watcher nothing is built and nothing is kept:

* ``stepped(stats)``, in the stepping thread after each step (``stepper.py``), and at
  a hand-over in a step (its cancels' blocks already back): the engine's statistics go
  into a bounded deque (appends are atomic); the oldest fall off, counted, if the loop
  does not route for a long while;
* ``routed(events)``, in the Trio thread after each batch of events is routed: the
  finishes are noted (a finish is the release of the sequence's blocks), and one frame
  is made (``ScopeFrame``: every open stream's row, the steps since the last frame, the
  pool, the moments) and put to every watcher, which drops it (and counts) when its
  queue is full (``ScopeWatcher.put``);
* ``closed(stream)``, from ``OpenStreams.unregister`` (the stream's ``close()``): the
  row's last state, and for a client that left, the time and step of the close, so that
  the release of its blocks, when the engine's finish for it is routed, is drawn as a
  ``disconnect`` moment: steps (the step that applied the cancel, counted from the
  close as the loop saw it) and ms (Trio's clock) from the close to the release.

Per-request notes live only while watched: the last watcher's leaving forgets them.
Frames are also kept in a short ring, so that a page reconnecting with ``Last-Event-ID``
gets what it missed; older than the ring, or from another server life, it gets a
snapshot (``snapshot``: every open row, the recently ended, the recent steps and
moments). Every method is sync and never a checkpoint.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

import trio

from engine import EngineEvent, EngineStatistics, FinishEvent, FinishReason, TokenEvent

from .policy import Policy
from .scope_types import ScopeFrame, ScopeMoment, ScopePool, ScopeRow, ScopeStep
from .scope_watcher import ScopeWatcher
from .stream import StreamEnd, StreamState, TokenStream

PENDING_STEPS = 256  # step statistics waiting for the next routing, at most
REPLAY_FRAMES = 128  # frames kept for a reconnecting page
RECENT_ROWS = 64  # ended rows a snapshot shows
RECENT_STEPS = 240  # steps a snapshot shows
RECENT_MOMENTS = 32  # moments a snapshot shows
TEXT_TAIL = 80  # characters of a stream's latest text, with the operator's setting on
_ENDS = {FinishReason.EOS: "eos", FinishReason.LENGTH: "length", FinishReason.STOP: "stop",
         FinishReason.ERROR: "error", FinishReason.DEADLINE: "deadline",
         FinishReason.CANCELLED: "cancelled"}


class OpenStreamsView(Protocol):
    """The hub's open streams as the feed reads them (``open_streams.OpenStreams``)."""

    def get(self, request_id: str) -> TokenStream | None: ...
    def all(self) -> list[TokenStream]: ...


class StepCount(Protocol):
    """The steps made so far, as the feed reads them (``stepper.Stepper``)."""

    @property
    def steps(self) -> int: ...


class ScopeFeed:
    """The publisher (module docstring).

    Args:
        policy: the watchers' (the hub's default policy: its queue limit and timeout).
        streams: the hub's open streams (``OpenStreams``).
        stepping: counts the steps the stepping thread made so far (``Stepper``).
    """

    def __init__(self, policy: Policy, *, streams: OpenStreamsView,
                 stepping: StepCount) -> None:
        self.policy = policy
        self._open = streams
        self._stepping = stepping
        self.watched = False  # the one check the step path makes
        self.show_text = False  # the operator's setting: rows carry their latest text
        self.key_of: Callable[[str], str | None] = lambda request_id: None
        # Whether a resumable stream has no reader now (the app's resume registry says).
        self.detached: Callable[[str], bool] = lambda request_id: False
        self._watchers: list[ScopeWatcher] = []
        self._epoch = secrets.token_hex(4)  # event ids of another server life never match
        self._seq = 0
        self._pending: deque[EngineStatistics] = deque(maxlen=PENDING_STEPS)
        self._frames: deque[ScopeFrame] = deque(maxlen=REPLAY_FRAMES)
        self._recent_rows: OrderedDict[str, ScopeRow] = OrderedDict()
        self._recent_steps: deque[ScopeStep] = deque(maxlen=RECENT_STEPS)
        self._recent_moments: deque[ScopeMoment] = deque(maxlen=RECENT_MOMENTS)
        self._last_stats: EngineStatistics | None = None
        self.frames_made = 0
        self.steps_lost = 0  # step statistics that fell off ``_pending``
        self._forget()

    def _forget(self) -> None:
        """Drop every per-request note (no one watches)."""
        self._ended: list[ScopeRow] = []  # since the last frame
        self._moments: list[ScopeMoment] = []  # since the last frame
        self._finishes: dict[str, FinishReason] = {}  # routed, the row not yet final
        self._closes: dict[str, tuple[float, int, ScopeRow]] = {}  # awaiting release
        self._keys: dict[str, str | None] = {}
        self._texts: dict[str, str] = {}
        self._paused: set[str] = set()
        self._dropped: set[str] = set()
        self._pending.clear()

    # -- watchers --------------------------------------------------------------------

    def subscribe(self, last_event_id: str | None = None, *,
                  tag: str | None = None) -> ScopeWatcher:
        """A new watcher: the frames after ``last_event_id`` if the ring still holds
        them all, else a snapshot first; ``tag`` names whose it is (the app's key name),
        for ``watching``. The caller closes it."""
        watcher = ScopeWatcher(self.policy, self.snapshot, self._unsubscribe, tag=tag)
        missed = self._since(last_event_id)
        if missed is None:
            watcher.start_with_snapshot()
        else:
            watcher.replay(missed)
        self._watchers.append(watcher)
        self.watched = True
        return watcher

    def _unsubscribe(self, watcher: ScopeWatcher) -> None:
        if watcher in self._watchers:
            self._watchers.remove(watcher)
        if not self._watchers:
            self.watched = False
            self._forget()

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def watching(self, tag: str | None) -> int:
        """How many watchers subscribed with ``tag`` are still subscribed (the app caps
        them per key: a watcher costs each step an encode and a write)."""
        return sum(1 for w in self._watchers if w.tag == tag)

    def _since(self, last_event_id: str | None) -> list[ScopeFrame] | None:
        epoch, _, seq = (last_event_id or "").partition("-")
        # ``len`` first: a seq of thousands of digits is no id of ours (and ``int`` of
        # it raises past Python's int max str digits).
        if epoch != self._epoch or not (seq.isascii() and seq.isdigit()) \
                or len(seq) > len(str(self._seq)) or int(seq) > self._seq:
            return None
        frames = [f for f in self._frames if _seq_of(f) > int(seq)]
        if len(frames) != self._seq - int(seq):
            return None  # some fell off the ring
        return frames

    # -- the hooks -------------------------------------------------------------------

    def stepped(self, stats: EngineStatistics) -> None:
        """A step's statistics, from the stepping thread (thread-safe: one append)."""
        if len(self._pending) == PENDING_STEPS:
            self.steps_lost += 1
        self._pending.append(stats)

    def routed(self, events: list[EngineEvent]) -> None:
        """A batch of events was routed (Trio thread): note the finishes, make a frame."""
        now = trio.current_time()
        for event in events:
            if isinstance(event, FinishEvent):
                self._finished(event, now)
            elif self.show_text and isinstance(event, TokenEvent):
                text = self._texts.get(event.request_id, "") + event.text
                self._texts[event.request_id] = text[-TEXT_TAIL:]
        self._publish(now)

    def closed(self, stream: TokenStream) -> None:
        """``stream`` closed (Trio thread): its last row; a client that left waits for
        the release of its blocks."""
        if not self.watched:
            return
        request_id = stream.request_id
        key = self._keys.pop(request_id) if request_id in self._keys else \
            self.key_of(request_id)
        row = self._row(stream, key=key, final=True)
        if row.state == "cancelled" and not row.released:
            self._closes[request_id] = (trio.current_time(), self._stepping.steps, row)
        self._end_row(row)

    def _finished(self, event: FinishEvent, now: float) -> None:
        request_id = event.request_id
        closing = self._closes.pop(request_id, None)
        if closing is not None:  # the client left: its blocks are back now
            closed_at, steps_at, row = closing
            self._end_row(dataclasses.replace(row, released=True))
            self._moment(ScopeMoment(
                "disconnect", request_id, row.key,
                "the client left: close() asked the engine to cancel; the step that "
                "applied it released the blocks", steps=self._stepping.steps + 1 - steps_at,
                ms=round((now - closed_at) * 1000, 3)))
        elif self._open.get(request_id) is not None:
            self._finishes[request_id] = event.reason

    # -- frames --------------------------------------------------------------------

    def _publish(self, now: float) -> None:
        steps, pool = self._take_steps()
        prefilling = {i for s in steps for i in s[1]}
        rows = [self._live_row(s, prefilling) for s in self._open.all()]
        self._seq += 1
        frame = ScopeFrame(f"{self._epoch}-{self._seq}", now, False,
                           (*rows, *self._ended), tuple(s[0] for s in steps), pool,
                           tuple(self._moments))
        self._ended, self._moments = [], []
        self._frames.append(frame)
        self.frames_made += 1
        for watcher in list(self._watchers):
            watcher.put(frame, now)

    def snapshot(self, missed: int = 0) -> ScopeFrame:
        """Everything a new (or lagging) watcher needs now, reporting ``missed``."""
        rows = [self._row(s, key=self._key(s.request_id)) for s in self._open.all()]
        stats = self._last_stats
        return ScopeFrame(f"{self._epoch}-{self._seq}", trio.current_time(), True,
                          (*rows, *self._recent_rows.values()), tuple(self._recent_steps),
                          None if stats is None else _pool(stats),
                          tuple(self._recent_moments), missed=missed)

    def _take_steps(self) -> tuple[list[tuple[ScopeStep, tuple[str, ...]]], ScopePool | None]:
        """The steps made since the last frame (with the requests each prefilled), the
        pool after the last of them, and their preemptions as moments."""
        taken = []
        while self._pending:
            stats = self._pending.popleft()
            last, self._last_stats = self._last_stats, stats
            if last is not None:
                self._count_preemptions(last, stats)
                if stats.steps == last.steps:  # a hand-over in the step: the pool only
                    continue
            step = ScopeStep(stats.steps, stats.last_step_ms, stats.last_step_decoded,
                             stats.last_step_prefilled, stats.step_target_ms)
            self._recent_steps.append(step)
            taken.append((step, stats.last_step_prefill_ids))
        latest = self._last_stats
        return taken, None if latest is None else _pool(latest)

    def _count_preemptions(self, last: EngineStatistics, stats: EngineStatistics) -> None:
        preempted = stats.preemptions - last.preemptions
        if preempted > 0:
            self._moment(ScopeMoment(
                "preemption", None, None, "running sequences gave their blocks back to "
                "make room; they pay by being prefilled again", count=preempted))
        for_band = stats.priority_preemptions - last.priority_preemptions
        if for_band > 0:
            self._moment(ScopeMoment(
                "priority", None, None, "a lower band's youngest stream gave its slot to "
                "a waiting higher band's (lower is sooner); it is prefilled again, bit for "
                "bit, and preempted so at most twice", count=for_band))
        recomputed = stats.recomputed_tokens - last.recomputed_tokens
        if recomputed > 0:
            self._moment(ScopeMoment(
                "recompute", None, None, "positions of preempted sequences prefilled "
                "again: the cost of the preemption", count=recomputed))

    def _live_row(self, stream: TokenStream, prefilling: set[str]) -> ScopeRow:
        """An open stream's row, noting the moments its change of state makes."""
        request_id = stream.request_id
        row = self._row(stream, key=self._key(request_id), prefilling=prefilling)
        if row.state == "paused" and request_id not in self._paused:
            self._paused.add(request_id)
            self._moment(ScopeMoment(
                "pause", request_id, row.key, "the slow reader's own slot pays: its "
                "sequence left the decode batch, keeping its blocks; the others decode on"))
        elif row.state != "paused" and request_id in self._paused:
            self._paused.discard(request_id)
            if not row.is_over:
                self._moment(ScopeMoment("resume", request_id, row.key,
                                         "the reader caught up: back in the decode batch"))
        if row.state == "dropped" and request_id not in self._dropped:
            self._dropped.add(request_id)
            self._moment(ScopeMoment(
                "drop", request_id, row.key, f"the slow reader itself pays: behind for "
                f"{stream.policy.stall_timeout_s} s, it was cancelled and its unsent "
                f"tokens discarded; its blocks return at the next step"))
        return row

    def _row(self, stream: TokenStream, *, key: str | None, final: bool = False,
             prefilling: set[str] | frozenset[str] = frozenset()) -> ScopeRow:
        """A stream's row from its statistics and the finishes noted for it."""
        request_id = stream.request_id
        stats = stream.statistics()
        # The terminal item (a finish or an error) is no token; a client gone has none.
        terminal = stats.end is not None and stats.end is not StreamEnd.CLIENT_GONE
        tokens = stats.delivered + stats.queued + stats.discarded - terminal
        finish = self._finishes.pop(request_id, None) if final else \
            self._finishes.get(request_id)
        if stats.end is StreamEnd.CLIENT_GONE:
            state = "cancelled"
        elif stats.end is StreamEnd.SHUTDOWN:
            state = "shutdown"
        elif stats.end is StreamEnd.ERROR:
            state = _ENDS[finish] if finish in (FinishReason.ERROR, FinishReason.DEADLINE) \
                else "dropped"
        elif stats.end is StreamEnd.FINISHED:
            state = _ENDS.get(finish, "finished") if finish is not None else "finished"
        elif stats.state is StreamState.WAITING:
            state = "prefilling" if request_id in prefilling else "waiting"
        else:
            state = "paused" if stats.is_paused else "running"
        if state in ("waiting", "running") and self.detached(request_id):
            state = "detached"  # it generates into its log, for a reader yet to come
        text = self._texts.pop(request_id, None) if final else self._texts.get(request_id)
        return ScopeRow(request_id, key, state, max(tokens, 0), stats.queued,
                        stream.policy.queue_limit, released=finish is not None,
                        text=text if self.show_text else None, band=stream.band)

    def _key(self, request_id: str) -> str | None:
        if request_id not in self._keys:
            self._keys[request_id] = self.key_of(request_id)
        return self._keys[request_id]

    def _end_row(self, row: ScopeRow) -> None:
        self._paused.discard(row.request_id)
        self._dropped.discard(row.request_id)
        self._ended.append(row)
        self._recent_rows[row.request_id] = row
        self._recent_rows.move_to_end(row.request_id)
        while len(self._recent_rows) > RECENT_ROWS:
            self._recent_rows.popitem(last=False)

    def _moment(self, moment: ScopeMoment) -> None:
        self._moments.append(moment)
        self._recent_moments.append(moment)


def _pool(stats: EngineStatistics) -> ScopePool:
    return ScopePool(total=stats.blocks_total, free=stats.blocks_free,
                     in_use=stats.blocks_reserved, cached=stats.blocks_cached,
                     shared=stats.blocks_shared)


def _seq_of(frame: ScopeFrame) -> int:
    return int(frame.event_id.rpartition("-")[2])
