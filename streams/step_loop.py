"""The hub's step loop: when the engine is stepped, and the Trio side of each stepping.

A job of its own, apart from ``hub.py``: the hub decides *whether* stepping goes on (its
state and its ledger: ``keep_going``) and what a failed step means for the streams; this
loop decides *when* to step, hands the stepping to the worker thread and takes it back.
What happens in that thread is ``stepper.py``'s.

Theory of operation
-------------------
The loop sleeps on its wake-up event while ``engine.has_work()`` is False; after a step
that produced no event (waiting requests that cannot be admitted while paused sequences
hold the batch) it sleeps too, for at most ``EMPTY_STEP_BACKOFF_S``. Whatever can give it
work (``Hub.open_stream``, a stream's close or resume, a drop, ``Hub.drain``) calls
``wake``, and the next TTFT deadline of a request in the engine ends the sleep too
(``TtftDeadlines.until_next``: one still waiting then is let go at that step).

To step, it hands ``Stepper.run_steps`` to ``run_step`` (default
``trio.to_thread.run_sync``, never abandoned: a step is an uncancellable critical section
that mutates the cache), then has the stepper route what it still holds (``release``).
A routing failure the stepper caught counts as the step's: the loop returns it.

Cancellation: at the wake-up wait, nothing to undo: the loop only waits. During a
stepping, the step in flight is finished first: ``run_step`` waits for its thread,
because a step cut short would leave the cache mutated under the next one;
``stop_stepping_when_cancelled``, run beside ``run``, makes the thread return after that
step instead of stepping on, so the bound is one step. What the stepper still holds is
routed (``release``, synchronous) before Cancelled propagates.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from .deadlines import TtftDeadlines
from .hub_types import RunStep, StepEngine
from .stepper import Stepper

# After a step with no event while has_work() is True (e.g. waiting requests that paused
# sequences keep out), step again when woken or after this long: about one decode step on
# the reference chapter's machine, so at most about one wasted step per step time.
EMPTY_STEP_BACKOFF_S = 0.01


class StepLoop:
    """Steps the engine when there is work (see the module docstring).

    Args:
        engine: asked only ``has_work()``, between steps.
        stepper: the stepping thread's side (``Stepper.run_steps``).
        run_step: how to run the stepping (``Hub``'s ``run_step``).
        deadlines: the TTFT deadlines that end an idle sleep.
    """

    def __init__(self, engine: StepEngine, stepper: Stepper, run_step: RunStep,
                 deadlines: TtftDeadlines) -> None:
        self._engine = engine
        self._stepper = stepper
        self._run_step = run_step
        self._deadlines = deadlines
        self._wake = trio.Event()

    def wake(self) -> None:
        """There may be work: step now (if idle). Sync, never a checkpoint."""
        self._wake.set()

    async def run(self, keep_going: Callable[[], bool]) -> Exception | None:
        """Step while ``keep_going()`` and there is work; return a step's exception, or
        None once ``keep_going()`` says no.

        Cancellation: at the wake-up wait, nothing to undo; during a stepping, the step
        in flight is finished first and its events routed, then Cancelled propagates
        (bound: one step, as the module docstring says).
        """
        idle = False  # the last step produced no event
        while keep_going():
            has_work = self._engine.has_work()
            if idle or not has_work:
                wait_s = EMPTY_STEP_BACKOFF_S if has_work else self._deadlines.until_next()
                with trio.move_on_after(wait_s):
                    await self._wake.wait()
                if self._wake.is_set():
                    self._wake = trio.Event()
                idle = False
                continue
            try:
                try:
                    idle = await self._run_step(self._stepper.run_steps)
                finally:
                    self._stepper.release()  # what it still holds: the thread is done
                if self._stepper.failure is not None:
                    raise self._stepper.failure
            except Exception as exc:  # Cancelled is a BaseException: it passes
                return exc
        return None

    async def stop_stepping_when_cancelled(self) -> None:
        """Sleep; when cancelled (the hub's task is, or its loop ended), tell the stepping
        thread to return after its step in flight, so that the loop sees the cancel.

        Cancellation: the cancel is its signal, and it keeps the loop's step finished
        first but short: ``Stepper.stop`` (synchronous, in a ``finally``, so it runs in
        the cancelled scope) makes the thread return after its step in flight rather
        than step on while work remains.
        """
        try:
            await trio.sleep_forever()
        finally:
            self._stepper.stop()
