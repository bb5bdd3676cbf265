"""Who holds blocks: the waiting queue, the running set, and the moves between them.

Theory of operation. At the start of each step's schedule (``Residency.grant``) every
decode row first gets the block its next position falls in (blocks on demand,
``admission.OnDemandAdmission``): a sequence holds the blocks of the positions it has
written plus the one it writes next. When a row needs a block and none is free, it
preempts by recompute: the victim is the most recently admitted running sequence (the
one that has had the least service, as vLLM does; possibly the row itself), its blocks
are released through the one release path, and it goes back to the head of the waiting
queue holding its tokens; readmitted, it prefills its prompt plus the tokens it
generated but the last (``Sequence.forget_cache``) and then decodes on, sampling nothing
twice. In a step that preempted, nobody is admitted (the victim would only be evicted
again). Then it admits waiting sequences in arrival order while there is a batch slot
and free blocks for a sequence's prefill, with ``watermark`` of the blocks left over
when others run (so that a new arrival does not at once cause a preemption); how many
positions a table covers at admission is the admission policy's
(``admission.AdmissionPolicy``: an injected one that covers all a sequence can need is
never preempted). Admission stops at the first one that does not fit, so a long request
is never overtaken forever by short ones, or (``PrefixCache.waits_for``) that would
compute a block another's prefill is computing: it shares it once committed.

Blocks go back to the allocator in two places only, both here: ``remove`` (the
scheduler's ``finish``, the only way out) and ``preempt``, which also drops the table
(a readmitted sequence gets a new one); so whatever mix of preemption, cancel and
finish, every table is released exactly once. The scheduler holds the same ``waiting``
and ``running`` (never rebound). Only the stepping thread touches any of it. Pure
Python: no torch.
"""

from __future__ import annotations

from collections import deque

from .admission import AdmissionPolicy
from .block_allocator import BlockAllocator
from .prefix_cache import PrefixCache
from .sequence import Sequence, SequenceState


class Residency:
    """The waiting queue and the running set over one allocator: admission, each decode
    row's growth and preemption by recompute (see above).

    Args:
        allocator: the block pool.
        prefix: the prefix cache over it (what an admission may share).
        max_batch: most sequences running at once (batch slots).
        max_prefill_tokens: the step's prompt-token cap (the prefix cache's ``defer``).
        admission: how many positions a table covers at admission.
        watermark: share of the blocks an admission leaves free while others run.
    """

    def __init__(
        self,
        allocator: BlockAllocator,
        prefix: PrefixCache,
        *,
        max_batch: int,
        max_prefill_tokens: int,
        admission: AdmissionPolicy,
        watermark: float,
    ) -> None:
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.allocator = allocator
        self.prefix = prefix
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.admission = admission
        self.watermark_blocks = int(watermark * allocator.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: dict[str, Sequence] = {}  # insertion order = admission order
        self.num_admitted = 0
        self.num_preemptions = 0

    def grant(self) -> None:
        """This step's blocks: every decode row's next one (preempting while none is
        free), then, unless that preempted, admission of what fits."""
        if not self.grow_decoding():
            self.admit()

    def fits(self, seq: Sequence) -> bool:
        """Whether ``seq`` fits now (the watermark only while others run: alone, one
        that fits the cache at all is admitted)."""
        headroom = self.watermark_blocks if self.running else 0
        return self.prefix.fits(seq, self.admission.positions_at_admission(seq), headroom)

    def admit(self) -> None:
        """Admit waiting sequences in arrival order up to the first that may not run now."""
        pending = self.prefix.in_flight(self.running.values())  # prefix cache: shared
        while self.waiting and len(self.running) < self.max_batch:
            head = self.waiting[0]
            if (not self.fits(head) or self.prefix.waits_for(head, pending)
                    or self.prefix.defer(self.running, self.max_prefill_tokens)):
                break
            self.waiting.popleft()
            positions = self.admission.positions_at_admission(head)
            # Invariant: a new table each time (never reused after its release).
            head.block_table = self.prefix.admit(head, positions)  # + a cached prefix
            head.state = SequenceState.RUNNING
            self.running[head.request_id] = head
            self.num_admitted += 1
            pending |= self.prefix.in_flight([head])  # the next waits for these

    def grow_decoding(self) -> bool:
        """Give every decode row the block its next position falls in, preempting the
        most recently admitted sequence while none is free; whether any was preempted."""
        preempted = False
        for seq in list(self.running.values()):
            if seq.state is not SequenceState.RUNNING or seq.is_paused or seq.needs_prefill:
                continue  # preempted just now, or writes nothing this step
            table, positions = seq.block_table, seq.num_cached + 1
            assert table is not None
            while self.allocator.blocks_to_grow(table, positions) > self.allocator.num_free:
                victim = next(reversed(self.running.values()))  # the newest: see above
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.allocator.grow(table, positions)
        return preempted

    def preempt(self, seq: Sequence) -> None:
        """Take a running sequence's blocks (released once, the table dropped) and put
        it at the head of the waiting queue; it keeps its tokens and its generator."""
        del self.running[seq.request_id]
        assert seq.block_table is not None
        self.allocator.release(seq.block_table)
        seq.block_table = None
        seq.state = SequenceState.WAITING
        seq.forget_cache()
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the waiting queue or the running set, releasing its
        blocks if it held any (the scheduler's ``finish``: its state is the caller's)."""
        if seq.state is SequenceState.RUNNING:
            del self.running[seq.request_id]
            assert seq.block_table is not None
            self.allocator.release(seq.block_table)
        elif seq.state is SequenceState.WAITING:
            self.waiting.remove(seq)
