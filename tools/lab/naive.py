"""``naive``: the slow-reader "policy" where everyone pays for one slow reader.

The reference chapter's counter-example, kept to be measured (the ``slowclient``
experiment): after every engine step the step loop waits until each naive stream's
reader took every item, so one reader that does not read stalls every stream. It is no
policy of the service (``streams.PolicyName`` lacks it, and a request naming it gets
the same 400 as any unknown policy); the lab installs it as the hub's ``run_step`` (the
seam every test uses to run the stepping its own way), on a lab server started with
``STREAMSCOPE_LAB_POLICY=naive``, whose streams otherwise behave as ``unbounded`` (the
queue grows; nobody is paused or dropped), as the naive policy's did.

How: ``NaiveStepping`` runs the stepper in the Trio thread, where it makes exactly one
step and routes its events at once (``Stepper.run_steps``' inline mode: the loop is
busy for the step, which is the device's own cost), then waits for the reader of every
stream on the server's default policy (a request that picks a policy of its own is not
naive, as on a server whose default policy was naive). To be waited for, the hub's
streams are ``NaiveStream``s (the hub's ``stream_type``): the service's ``TokenStream``
carries no wait of the lab's. ``NaiveStepping.make_hub`` makes such a hub
(``create_app(make_hub=...)``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import trio

from streams import (
    Hub,
    HubSettings,
    PolicyName,
    RunStep,
    StepEngine,
    StreamEnd,
    StreamError,
    StreamItem,
    StreamState,
    TokenStream,
)

NAIVE = "naive"
# What a naive stream's queue does: grow without limit (the step loop bounds it).
NAIVE_QUEUE_POLICY = PolicyName.UNBOUNDED
# Every policy the slowclient experiment measures: the lab's first, then the service's.
LAB_POLICIES = (NAIVE, *(p.value for p in PolicyName))


class NaiveStream(TokenStream):
    """A ``TokenStream`` the naive step loop can wait for: it tells ``wait_until_taken``
    when its reader took the last queued item, or it ended from outside, or it closed."""

    @functools.cached_property
    def _taken(self) -> trio.lowlevel.ParkingLot:
        """Where ``wait_until_taken``'s waiter (the step loop) parks."""
        return trio.lowlevel.ParkingLot()

    async def wait_until_taken(self) -> None:
        """Wait until the reader took every item, or the hub ended the stream with an
        error (its backlog replaced), or it closed. May return without a checkpoint.

        Cancellation: nothing to undo: a wait; the stream and its queue are unchanged.
        """
        while True:
            now = self.statistics()
            if not now.queued or now.state is StreamState.CLOSED \
                    or now.end in (StreamEnd.ERROR, StreamEnd.SHUTDOWN):
                return
            await self._taken.park()

    # Each way the queue empties or the stream ends, told once it happened: a take
    # returns with no checkpoint after it (``TokenStream.receive``), so the waiter wakes
    # in the same turn as it did when the stream itself told it.

    async def receive(self) -> StreamItem:
        try:
            return await super().receive()
        finally:
            self._tell_if_taken()

    def take_ready(self, max_items: int) -> list[StreamItem]:
        items = super().take_ready(max_items)
        self._tell_if_taken()
        return items

    async def receive_batch(self, max_items: int) -> list[StreamItem]:
        try:
            return await super().receive_batch(max_items)
        finally:
            self._tell_if_taken()

    def fail(self, error: StreamError, end: StreamEnd) -> bool:
        failed = super().fail(error, end)
        self._taken.unpark_all()
        return failed

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._taken.unpark_all()

    def _tell_if_taken(self) -> None:
        if not self.statistics().queued:
            self._taken.unpark_all()


async def step_inline(run_steps: Callable[[], bool]) -> bool:
    """Run the stepping in this (the Trio) thread: one step, its events routed now.

    Cancellation: nothing to undo at its one checkpoint, before the step; once begun,
    the step runs in this thread with no checkpoint, so it is finished first by
    construction (a cut step would leave the cache mutated under the next).
    """
    await trio.lowlevel.checkpoint()
    return run_steps()


class NaiveStepping:
    """The hub's ``run_step`` of the naive policy (see the module docstring).

    Args:
        hub: the hub whose streams it waits for (None until it is built); by default the
            one ``make_hub`` made. A test that builds its own hub passes it, and has the
            hub open ``NaiveStream``s.
        step: how one step is run; a test passes one that costs virtual time.
    """

    def __init__(self, hub: Callable[[], Hub | None] | None = None,
                 step: RunStep = step_inline) -> None:
        self._made: Hub | None = None
        self._hub = hub or (lambda: self._made)
        self._step = step

    def make_hub(self, engine: StepEngine, settings: HubSettings) -> Hub:
        """A hub over ``engine`` that steps this way and opens ``NaiveStream``s (the
        app's ``make_hub``); the one it waits for from now on."""
        self._made = Hub(engine, settings, run_step=self, stream_type=NaiveStream)
        return self._made

    async def __call__(self, run_steps: Callable[[], bool]) -> bool:
        """One step, then wait until each naive stream's reader took every item.

        Cancellation: nothing to undo at the step's checkpoint (``step_inline``) or at
        a wait for a reader (the step and its routing are done; the loop's next call
        steps again); the step itself is finished first, never cut.
        """
        idle = await self._step(run_steps)
        hub = self._hub()
        if hub is not None:
            for stream in hub.streams():
                if stream.policy is hub.default_policy and isinstance(stream, NaiveStream):
                    await stream.wait_until_taken()
        return idle
