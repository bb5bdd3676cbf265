"""The wishes other threads post to the engine, applied by the stepping thread.

``submit``, ``cancel``, ``pause`` and ``resume`` may be called from any thread while a
step runs; none of them touches a sequence or the cache. They only append a wish here,
under one lock, and the scheduler takes them all at the start of the next step
(``Scheduler.apply_inbox``), so every change to the running set happens in the step.

The inbox also keeps the ids that are live (submitted and not finished), so that a
duplicate is refused at once in the submitting thread, and the prompt tokens of the
submits not applied yet, which a TTFT estimate counts as queued ahead. Pure Python.
"""

from __future__ import annotations

import enum
import threading

from .errors import DuplicateRequestId
from .sequence import Sequence


class Op(enum.Enum):
    """A wish posted to the inbox, applied at the next step boundary."""

    CANCEL = "cancel"  # end the request: finish it waiting or running
    PAUSE = "pause"  # leave it out of the decode batch; it keeps blocks and slot
    RESUME = "resume"  # take it back into the decode batch


Wish = Sequence | tuple[Op, str]


class Inbox:
    """Thread-safe: every method may be called from any thread."""

    def __init__(self) -> None:
        self._wishes: list[Wish] = []
        self._live_ids: set[str] = set()  # submitted and not yet finished
        self._prompt_tokens = 0  # prompt tokens of the submits in the inbox
        self._lock = threading.Lock()  # guards the three

    def post_submit(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises DuplicateRequestId if its id is live."""
        with self._lock:
            if seq.request_id in self._live_ids:
                raise DuplicateRequestId(f"request id {seq.request_id!r} is in use")
            self._live_ids.add(seq.request_id)
            self._wishes.append(seq)
            self._prompt_tokens += seq.num_prompt_tokens

    def post(self, op: Op, request_id: str) -> None:
        with self._lock:
            self._wishes.append((op, request_id))

    def take(self) -> list[Wish]:
        """Every wish posted since the last take, in order; the inbox is empty after."""
        with self._lock:
            wishes, self._wishes = self._wishes, []
            self._prompt_tokens = 0
        return wishes

    def is_empty(self) -> bool:
        with self._lock:
            return not self._wishes

    def pending(self) -> list[Wish]:
        """A copy of the wishes not taken yet (for a test to look at)."""
        with self._lock:
            return list(self._wishes)

    def prompt_tokens(self) -> int:
        """Prompt tokens of the submits not applied yet."""
        with self._lock:
            return self._prompt_tokens

    def submits(self) -> int:
        """Submits not applied yet."""
        with self._lock:
            return sum(isinstance(wish, Sequence) for wish in self._wishes)

    def retire(self, request_id: str) -> None:
        """The request finished: its id may be used again."""
        with self._lock:
            self._live_ids.discard(request_id)
