"""The stepping thread: engine steps back to back, their events delivered behind them.

The hub's step loop hands ``Stepper.run_steps`` to ``run_step`` (by default
``trio.to_thread.run_sync``). It owns what happens in the worker thread and nothing
else: it knows the engine as ``StepEngine`` and the Trio side as one routing function.

Theory of operation
-------------------
A step's events reach the Trio thread with ``TrioToken.run_sync_soon`` (first in, first
out), and the thread goes straight on to the next step: it does not wait for the event
loop to be scheduled, to route the events or to write them. That wait was the cost of
one step per ``to_thread`` call: the hub's task woke only after every stream task that
the previous step had woken had written its bytes, so the engine idled while the loop
wrote, and the loop wrote one token per stream per step. Now the step runs while the
loop writes (the overlap), and when the loop falls behind, several steps' tokens are
queued for a stream by the time its task runs, and go out in one write (the body's
coalescing).

Coalescing under load. Steps' events are routed ``stride`` steps at a time, and only
once every writer that the last routing gave items has come back for more (``hold``
says no; the hub calls ``caught_up``): a writer then finds ``stride`` tokens queued and
writes them in one go, paying the per-write cost (Quart, hypercorn, h11, the socket)
once for them. The stride follows the load: it is the smallest that keeps a *wave* (from
a routing until every writer is back) within ``LOOP_SHARE`` of the time the engine took
for the steps it delivers, so one stream is written token by token (its wave is tiny)
and hundreds are written a few tokens a write. Both threads need the GIL: a wave that
writes token by token takes the step thread's time as well as the loop's, and the loop
never seems to lag, so the stride cannot wait for a lag to show; it is set from the two
measured times. A prefill's events (first tokens) are never held: they are routed with
everything held before them, in order.

At most ``steps_ahead`` steps are stepped but not yet routed: past that the thread waits
for the loop. That bounds the events in flight, the delivery latency it adds (at most
that many steps) and how far a policy can lag: a pause or a drop is decided when the
events are routed, so the engine may make up to ``steps_ahead`` more tokens for a
reader that is already behind.

The thread returns to the hub's loop (``run_steps`` returns) when the engine has no
work, after a step that produced no event (the loop backs off), or after ``stop()``.
Whether stepping goes on at all (a drain, the hub's ledger) is the loop's question,
asked between ``run_steps`` calls (``step_loop.py``); a device that waits for readers
after each step (the lab's ``naive``) runs the stepping inline, one step a call.

Invariants:
- The engine's wishes (submit, cancel, pause, resume) are applied at the start of a
  step, as before: the thread only calls ``engine.step`` and ``engine.has_work``.
- Every posted batch is routed, in order, before the hub goes on after its ``run_step``
  call: the thread's own completion reaches Trio through the same first-in-first-out
  queue, behind them, and the hub calls ``release()`` for what is still held.
- Routing runs in the Trio thread only. A routing function that raises stops the
  stepping (``failure`` holds the exception); it must not escape into Trio's queue.

Inline mode: where ``run_step`` calls ``run_steps`` in the Trio thread (tests, with a
step that costs virtual time), it makes exactly one step and routes it at once.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Protocol

import trio

from engine import EngineEvent, EngineStatistics

from .hub_types import StepEngine

# Steps the thread may be ahead of the loop's routing: the largest stride and one step of
# slack, so that the thread steps on while a stride is held. 1 would be lock-step.
# Measured with ``python -m tools.servicebench`` (docs/results.md, "The serving path").
DEFAULT_STEPS_AHEAD = 4
# A wave may take at most this share of the engine time of the steps it writes. Once a
# write cost no schedule point (app/edge/body_hot_path.py) the loop kept up at stride 1
# and paid its per-write cost (the send system call, most of it) once a token: 0.25
# makes the stride larger. Tiny model, 128 streams, alternated runs on a busy machine:
# loop CPU a token 46-52 us at 0.5, 33-39 at 0.25, 38-41 at 0.15, gap p99 alike.
LOOP_SHARE = 0.25
SMOOTHING = 0.2  # of the moving averages of a step's and a wave's time


class StepWatch(Protocol):
    """Who watches the steps (``scope_feed.ScopeFeed``): ``watched`` is read once a step
    and once a routing; the rest is called only while it is True."""

    watched: bool

    def stepped(self, stats: EngineStatistics) -> None:
        """A step's statistics, in the stepping thread, before its events are posted;
        also the statistics of a hand-over in the step (the same ``steps``)."""

    def routed(self, events: list[EngineEvent]) -> None:
        """A batch of events was routed, in the Trio thread."""


class Stepper:
    """Steps ``engine`` in a worker thread; see the module docstring.

    Args:
        engine: the engine; only ``step`` and ``has_work`` are called, in the thread.
        route: delivers a batch of events, in the Trio thread; never blocks.
        hold: read in the Trio thread: True while writers are still busy with the
            last routing's items (hold the next step's events; see the docstring).
        steps_ahead: steps stepped and not yet routed, at most (>= 1).
        watch: told of each step and routing while it watches (the hub's scope, which
            it sets on ``watch`` once both exist: the scope counts this stepper's steps).
    """

    def __init__(
        self,
        engine: StepEngine,
        route: Callable[[list[EngineEvent]], None],
        *,
        hold: Callable[[], bool] = lambda: False,
        steps_ahead: int = DEFAULT_STEPS_AHEAD,
        watch: StepWatch | None = None,
    ) -> None:
        if steps_ahead < 1:
            raise ValueError(f"steps_ahead must be >= 1, not {steps_ahead}")
        self._engine = engine
        self._route = route
        self.watch = watch
        self._hold = hold
        self._held: list[list[EngineEvent]] = []  # Trio thread only: batches not routed yet
        self._held_steps = 0  # of which whole steps
        self.steps_ahead = steps_ahead
        self._room = threading.Condition()
        self._unrouted = 0  # steps posted, not yet routed; guarded by _room
        self._stopped = False  # guarded by _room
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self.failure: Exception | None = None  # what routing raised; stepping stops
        self._prefilled = False  # the step in flight handed events to on_prefill
        self.steps = 0  # steps made (the thread writes, anyone reads)
        self.loop_wait_s = 0.0  # time the thread waited for the loop to route
        self.routings = 0  # times held steps were routed (Trio thread)
        self.stride = 1  # steps routed at a time (Trio thread; see the docstring)
        self._step_s = 0.0  # moving average of a step's wall time (written by the thread)
        self._wave_s = 0.0  # moving average of a wave's wall time (Trio thread)
        self._wave_started: float | None = None

    def bind(self) -> None:
        """Remember the Trio run to post to; call in it before the first ``run_steps``."""
        self._trio_token = trio.lowlevel.current_trio_token()

    def stop(self) -> None:
        """Make ``run_steps`` return after the step in flight (or at once if waiting).
        Thread-safe, idempotent, never blocks for long."""
        with self._room:
            self._stopped = True
            self._room.notify_all()

    def run_steps(self) -> bool:
        """Step until there is nothing to step (see the module docstring).

        Returns:
            True if the last step produced no event (the loop should back off).

        Raises:
            Exception: whatever ``engine.step`` raised; every event of the steps
                before it has been posted.
        """
        if trio.lowlevel.in_trio_run():
            self._prefilled = False
            events = self._engine.step(on_prefill=self._route_now)
            self.steps += 1
            self._watch_step()
            self._route_watched(events)
            return not events and not self._prefilled
        while self._wait_for_room():
            self._prefilled = False
            started = time.perf_counter()
            events = self._engine.step(on_prefill=self._post)
            self._step_s = _smooth(self._step_s, time.perf_counter() - started)
            self.steps += 1
            self._watch_step()
            if events:
                with self._room:
                    self._unrouted += 1
                self._post_step(events)
            if not events and not self._prefilled:
                return True
            if not self._engine.has_work():
                return False
        return False

    def _wait_for_room(self) -> bool:
        """Wait while ``steps_ahead`` steps are unrouted; False once stopped."""
        with self._room:
            if self._unrouted >= self.steps_ahead and not self._stopped:
                started = time.perf_counter()
                while self._unrouted >= self.steps_ahead and not self._stopped:
                    self._room.wait()
                self.loop_wait_s += time.perf_counter() - started
            return not self._stopped

    def _route_now(self, events: list[EngineEvent]) -> None:
        """on_prefill, inline: route in this (the Trio) thread."""
        self._prefilled = self._prefilled or bool(events)
        self._watch_step()  # the pool as the hand-over left it (a cancel's blocks back)
        self._route_watched(events)

    def _post(self, events: list[EngineEvent]) -> None:
        """on_prefill: the prefill's events go to the loop now; the step goes on."""
        self._prefilled = self._prefilled or bool(events)
        if events:
            self._watch_step()  # as in _route_now
            self._token().run_sync_soon(self._deliver, events, False)

    def _post_step(self, events: list[EngineEvent]) -> None:
        self._token().run_sync_soon(self._deliver, events, True)

    def _deliver(self, events: list[EngineEvent], ends_step: bool) -> None:
        """In the Trio thread, from Trio's queue: hold the batch, or route what is held."""
        self._held.append(events)
        self._held_steps += ends_step
        if (not ends_step or self._held_steps >= self.steps_ahead
                or (self._held_steps >= self.stride and not self._hold())):
            self.release()

    def caught_up(self) -> None:
        """Every writer is back for more: the wave is over. Adapt the stride to it, and
        route what is held if it makes a stride. Trio thread; sync."""
        if self._wave_started is not None:
            self._wave_s = _smooth(self._wave_s, time.perf_counter() - self._wave_started)
            self._wave_started = None
            if self._step_s > 0:
                wanted = math.ceil(self._wave_s / (LOOP_SHARE * self._step_s))
                self.stride = max(1, min(self.steps_ahead - 1, wanted))
        if self._held_steps >= self.stride:
            self.release()

    def release(self) -> None:
        """Route every held batch, in order, and make room for as many steps. In the Trio
        thread; sync, never a checkpoint; a no-op when nothing is held."""
        if not self._held:
            return
        held, steps = self._held, self._held_steps
        self._held, self._held_steps = [], 0
        self.routings += 1
        if self._wave_started is None:
            self._wave_started = time.perf_counter()
        try:
            for events in held:
                if self.failure is None:
                    self._route_watched(events)
        except Exception as exc:  # must not reach Trio's queue runner: it would crash the run
            self.failure = exc
            self.stop()
        finally:
            with self._room:
                self._unrouted -= steps
                self._room.notify_all()

    def _watch_step(self) -> None:
        watch = self.watch
        if watch is not None and watch.watched:
            watch.stepped(self._engine.statistics())

    def _route_watched(self, events: list[EngineEvent]) -> None:
        self._route(events)
        watch = self.watch
        if watch is not None and watch.watched:
            watch.routed(events)

    def _token(self) -> trio.lowlevel.TrioToken:
        if self._trio_token is None:
            raise RuntimeError("Stepper.bind() was not called in the Trio run")
        return self._trio_token


def _smooth(average: float, sample: float) -> float:
    return sample if average == 0 else average + SMOOTHING * (sample - average)
