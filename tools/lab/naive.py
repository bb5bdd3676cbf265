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
naive, as on a server whose default policy was naive).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from streams import Hub, PolicyName, RunStep

NAIVE = "naive"
# What a naive stream's queue does: grow without limit (the step loop bounds it).
NAIVE_QUEUE_POLICY = PolicyName.UNBOUNDED
# Every policy the slowclient experiment measures: the lab's first, then the service's.
LAB_POLICIES = (NAIVE, *(p.value for p in PolicyName))


async def step_inline(run_steps: Callable[[], bool]) -> bool:
    """Run the stepping in this (the Trio) thread: one step, its events routed now.

    Cancellation: at the checkpoint before the step only; the step itself has none.
    """
    await trio.lowlevel.checkpoint()
    return run_steps()


class NaiveStepping:
    """The hub's ``run_step`` of the naive policy (see the module docstring).

    Args:
        hub: the hub whose streams it waits for (None until the server has built it).
        step: how one step is run; a test passes one that costs virtual time.
    """

    def __init__(self, hub: Callable[[], Hub | None], step: RunStep = step_inline) -> None:
        self._hub = hub
        self._step = step

    async def __call__(self, run_steps: Callable[[], bool]) -> bool:
        """One step, then wait until each naive stream's reader took every item.

        Cancellation: at the step's checkpoint or at a wait; the step is never cut.
        """
        idle = await self._step(run_steps)
        hub = self._hub()
        if hub is not None:
            for stream in hub.streams():
                if stream.policy is hub.default_policy:
                    await stream.wait_settled()
        return idle
