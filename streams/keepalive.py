"""One timer for every stream's keep-alive, in place of a timeout scope around each wait.

A writer with nothing to write waits in its source's ``receive_batch``; after
``interval_s`` of quiet it sends a keep-alive (an SSE comment), so that proxies and
clients see the connection live. Wrapping each wait in ``trio.move_on_after`` did that,
but a timeout scope entered and left per wait is on the path of every write of every
stream whose writer keeps pace with the engine, and it cost about as much as the write
itself (tools/writebench.py at a0b2ba5: a park and wake-up with and without the scope).

Here a writer says when it begins to wait (``waiting``: a dict entry) and when it woke
(``back``); one task (``run``) looks every ``interval_s / TICKS`` and nudges each writer
that has waited ``interval_s`` or longer: its source's ``nudge()`` makes the waiting
``receive_batch`` return no items, and the writer sends its keep-alive. So a keep-alive
goes out after between 1 and ``1 + 1/TICKS`` intervals of quiet. A nudge takes nothing
from the source, and a writer's cancellation is unchanged (it is cancelled at the same
wait, which no scope of ours surrounds).
"""

from __future__ import annotations

from typing import Protocol

import trio

TICKS = 4  # looks per interval: a keep-alive is at most a quarter interval late


class Nudgeable(Protocol):
    """A source whose waiting ``receive_batch`` ``nudge()`` ends with no items."""

    def nudge(self) -> None:
        """Wake a waiting reader with nothing for it. Sync, never a checkpoint; a no-op
        when no reader waits."""
        ...


class Keepalives:
    """The keep-alive timer of every writer that uses it (see the module docstring).

    Args:
        interval_s: the quiet after which a writer sends a keep-alive (> 0).
    """

    def __init__(self, interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, not {interval_s}")
        self.interval_s = interval_s
        self._waiting: dict[int, tuple[Nudgeable, float]] = {}  # id(source): since when
        self.nudges = 0

    def waiting(self, source: Nudgeable) -> None:
        """A writer waits on ``source`` from now. Sync; in the Trio run."""
        self._waiting[id(source)] = (source, trio.current_time())

    def back(self, source: Nudgeable) -> None:
        """The writer waiting on ``source`` woke (items, a nudge, a cancel). Sync."""
        self._waiting.pop(id(source), None)

    def tick(self, now: float) -> None:
        """Nudge every writer that has waited ``interval_s`` or longer by ``now``."""
        due = [key for key, (_, since) in self._waiting.items()
               if now - since >= self.interval_s]
        for key in due:
            source, _ = self._waiting.pop(key)
            self.nudges += 1
            source.nudge()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Tick until cancelled (the app's nursery closes).

        Cancellation: nothing to undo: a cancel is the way it stops; a tick in progress
        is synchronous, so none is left half done.
        """
        task_status.started()
        while True:
            await trio.sleep(self.interval_s / TICKS)
            self.tick(trio.current_time())
