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

Bands and fair shares (``engine.priority``). Before each admission the waiting queue is
ordered (``priority.order_waiting``: band, the tenant's virtual token counter, started
ones, arrival; all one band and one tenant, that is arrival order with the
preempted at the head, as above; then aging's lifted heads, ``engine.aging``), and an
admitted prompt is charged to its tenant. Each step starts the bands' aging clocks
(``Aging.tick``); an admission restarts its band's, and a head admitted lifted keeps
the band it rose to while it runs (``Sequence.aged_band``; a preemption drops it). In a
step that preempted nobody for blocks, a head that cannot be admitted because the batch
or the pool is full makes the highest band waiting preempt the lowest band's youngest
running sequence below its own band (``priority.priority_victim``, at most one a step);
an exhausted pool's victim is also the lowest band's youngest (all one band: the newest,
as above).

Blocks go back to the allocator in two places only, both here: ``remove`` (the
scheduler's ``finish``, the only way out) and ``preempt``, which also drops the table
(a readmitted sequence gets a new one); so whatever mix of preemption, cancel and
finish, every table is released exactly once. The scheduler holds the same ``waiting``
and ``running`` (never rebound). Only the stepping thread touches any of it. Pure
Python: no torch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from .admission import AdmissionPolicy
from .aging import Aging
from .block_allocator import BlockAllocator
from .prefix_cache import PrefixCache
from .priority import (
    BandStatistics,
    FairShare,
    lowest_band_youngest,
    order_waiting,
    ordered_waiting,
    priority_victim,
)
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
        clock: what a queue wait is measured with (the scheduler's).
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
        clock: Callable[[], float],
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
        self.num_priority_preemptions = 0  # of those, for a higher band
        self.fair = FairShare()  # the tenants' counters (``engine.priority``)
        self.bands = BandStatistics()
        self.aging = Aging()  # the floor of progress under strict bands (``engine.aging``)
        self.clock = clock

    def grant(self) -> None:
        """This step's blocks: every decode row's next one (preempting while none is
        free), then, unless that preempted, a preemption for a higher band if one
        waits that does not fit, and admission of what fits."""
        self.aging.tick(self.waiting, self.running.values())
        if not self.grow_decoding():
            self.preempt_for_priority()
            self.admit()

    def enqueue(self, seq: Sequence) -> None:
        """A submitted sequence joins the tail of the waiting queue."""
        seq.entered_queue_step = self.aging.steps
        self.waiting.append(seq)

    def preempt_for_priority(self) -> None:
        """At most one preemption for a higher band (``priority_victim_now``)."""
        order_waiting(self.waiting, self.fair, self.aging, self.running.values())
        victim = self.priority_victim_now()
        if victim is not None:
            self.preempt(victim, by_priority=True)

    def priority_victim_now(self) -> Sequence | None:
        """Whom a preemption for a higher band would take now (reads only): the queue's
        head (ordered) cannot be admitted because the batch or the pool is full, and a
        band lower than the highest band waiting runs (``priority_victim``: judged by the
        first waiting sequence of that band, whatever head aging put before it)."""
        if not self.waiting:
            return None
        ordered, _ = ordered_waiting(self.waiting, self.fair, self.aging, self.running.values())
        if len(self.running) < self.max_batch and self.fits(ordered[0]):
            return None
        highest = min(ordered, key=lambda s: s.request.priority)  # the first of its band
        return priority_victim(self.running.values(), highest)

    def fits(self, seq: Sequence) -> bool:
        """Whether ``seq`` fits now (the watermark only while others run: alone, one
        that fits the cache at all is admitted)."""
        headroom = self.watermark_blocks if self.running else 0
        return self.prefix.fits(seq, self.admission.positions_at_admission(seq), headroom)

    def admit(self) -> None:
        """Admit waiting sequences in arrival order up to the first that may not run now."""
        pending = self.prefix.in_flight(self.running.values())  # prefix cache: shared
        while self.waiting and len(self.running) < self.max_batch:
            # Again each time: the last admission charged a tenant and restarted a clock.
            lifted = order_waiting(self.waiting, self.fair, self.aging, self.running.values())
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
            head.aged_band = lifted.get(head)  # kept while it runs (``engine.aging``)
            self.aging.admitted(head)
            self.bands.left_queue(head.request.priority,
                                  max(self.aging.steps - head.entered_queue_step - 1, 0),
                                  head.aged_band is not None)
            self.admitted(head)
            pending |= self.prefix.in_flight([head])  # the next waits for these

    def admitted(self, seq: Sequence) -> None:
        """Count a first admission's queue wait in its band, and charge the prompt
        positions it will compute (not a cached prefix, not a recompute) to its tenant."""
        if seq.was_admitted:
            return
        seq.was_admitted = True
        waited = 0.0 if seq.submitted_at is None else self.clock() - seq.submitted_at
        self.bands.admit(seq.request.priority, max(waited, 0.0))
        if not seq.generated_ids:
            self.fair.charge(seq.request.tenant, prefill_tokens=seq.num_to_cache)
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
                victim = lowest_band_youngest(self.running.values())  # see above
                self.preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                self.allocator.grow(table, positions)
        return preempted

    def preempt(self, seq: Sequence, by_priority: bool = False) -> None:
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
        seq.num_priority_preemptions += by_priority
        if by_priority:  # past the cap it is a victim again only after progress
            seq.generated_at_priority_preemption = len(seq.generated_ids)
        self.num_priority_preemptions += by_priority
        self.bands.preempt(seq.request.priority, by_priority)
        seq.aged_band = None  # it waits in its own band again
        seq.entered_queue_step = self.aging.steps
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
