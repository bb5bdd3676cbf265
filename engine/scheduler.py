"""Who waits, who runs: admission in arrival order under slot and block limits.

Theory of operation. A sequence waits in arrival order until there is a batch
slot for it and enough free blocks for everything it can ever need (prompt
plus max new tokens); then it is admitted and holds that reservation until it
finishes. Admission stops at the first waiting sequence that does not fit, so
a long request is never overtaken forever by short ones (arrival order holds).
Finishing is the only way out of the running set, and it releases the blocks
through the allocator: the one place they are freed. Pure Python: no torch.
"""

from __future__ import annotations

from collections import deque

from .kv_cache import BlockAllocator
from .sequence import Sequence, SequenceState


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_batch: int) -> None:
        self.allocator = allocator
        self.max_batch = max_batch
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # insertion order = admission order
        self.num_admitted = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def find(self, request_id: str) -> Sequence | None:
        if request_id in self.running:
            return self.running[request_id]
        return next((s for s in self.waiting if s.request_id == request_id), None)

    def admit(self) -> list[Sequence]:
        """Admit waiting sequences in arrival order while slots and blocks allow."""
        admitted = []
        while self.waiting and len(self.running) < self.max_batch:
            head = self.waiting[0]
            if not self.allocator.can_reserve(head.max_tokens):
                break
            self.waiting.popleft()
            head.block_table = self.allocator.reserve(head.request_id, head.max_tokens)
            head.state = SequenceState.RUNNING
            self.running[head.request_id] = head
            self.num_admitted += 1
            admitted.append(head)
        return admitted

    def prefillable(self) -> list[Sequence]:
        """Admitted, unpaused sequences whose prompt has not been run yet."""
        return [s for s in self.running.values() if not s.is_paused and not s.generated_ids]

    def decodable(self) -> list[Sequence]:
        """Running, unpaused sequences that already have a token to feed back."""
        return [s for s in self.running.values() if not s.is_paused and s.generated_ids]

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out for good; release its blocks if it held any."""
        if seq.state is SequenceState.RUNNING:
            del self.running[seq.request_id]
            assert seq.block_table is not None
            self.allocator.release(seq.block_table)
        elif seq.state is SequenceState.WAITING:
            self.waiting.remove(seq)
        seq.state = SequenceState.FINISHED

    @property
    def num_paused(self) -> int:
        return sum(s.is_paused for s in self.running.values())
