"""Priority bands and fair shares by work: the waiting queue's order and a band's victim.

Theory of operation. Every request has a ``priority`` (vLLM's field: lower is sooner),
its band, and a ``tenant`` (the app passes the API key's name; "" for all others). The
residency admits from the head of its waiting queue, so the order of that queue is the
scheduling policy; ``order_waiting`` sorts it, stably, before each admission by:

1. band: a lower ``priority`` first (strict priority between bands, but for the floor
   of progress below);
2. within a band, the tenant with the least *virtual token counter* first (VTC, Sheng et
   al., "Fairness in Serving Large Language Models", OSDI 2024): each tenant's counter
   grows by the work the engine did for it, prefill tokens and decode tokens weighted as
   the step's costs weigh them (``FairShare.weigh``), so a tenant with long prompts and
   long answers is served less often, in proportion, than one with short ones, and two
   tenants that keep work waiting get equal work whatever their stream counts;
3. then a sequence that has already streamed tokens (a preempted one, to be recomputed)
   before one that has not;
4. then, among fresh sequences, the earliest ``ttft_deadline`` first (one without a
   deadline last): earliest deadline first breaks the tie of equal counters (mostly one
   tenant's own requests), never the band's or the fair share's order. The deadline gate
   stays sound: it judges a new request against all the waiting work of its band and
   above (``ttft``), wherever it lands within its band; a request it overtakes either
   has no deadline (it was promised nothing) or a later one, and earliest-deadline-first
   is the order that meets every deadline when any order can;
5. then arrival (the sort is stable and the queue is in arrival order, a preempted
   sequence at its head);
6. last, aging (``engine.aging``): the head of a band that higher bands have passed
   over for ``PRIORITY_AGING_STEPS`` steps per band present above it moves up to the
   band it has risen to, first in it (``ordered_waiting``).

Idle credit is bounded as VTC bounds it: a tenant with nothing in the engine that submits
gets its counter lifted to the least counter of the tenants that have work in it
(``FairShare.arrive``), so being idle banks nothing; with nobody active the counters are
all forgotten (nothing to be fair against), which also bounds the table between idles.

Preemption by priority (``priority_victim``): when the head of the queue, after ordering,
cannot be admitted because the batch or the pool is full, and a sequence runs at a band
lower (a greater value) than the highest band waiting, the lowest running band's youngest
sequence is preempted by recompute (``Residency.preempt``: its answer continues bit for
bit), at most one per step. A running sequence's band is the one it was admitted at
(``aging.band_of``: aging's, kept while it runs); a waiting one preempts by its own band
only, never by the band aging lifted it to.

Floor of progress, two halves. Once running: a sequence preempted by priority
``PRIORITY_PREEMPTION_CAP`` times is a priority victim again only once it has made
``PRIORITY_PROGRESS_TOKENS`` new tokens since its last such preemption
(``may_preempt_for_priority``; it still yields to an exhausted pool, as every sequence
does), so past the cap each priority preemption is paid for by that much progress and it
is never starved; one admitted by aging is not the victim of the band it overtook either.
(Without the renewal, "never again" past the cap, a flex flood kept up beside a steady
interactive band ended with every running flood stream capped, slowed by the band
yielding, and the interactive band waiting for one to finish: its TTFT p95 5.95 times
idle in ``tools.lab priority`` in int4.) Once waiting (fresh, or preempted and waiting to
be readmitted): bands are strict only for waits under the aging period; a band's head
passed over by higher bands rises one band present per ``PRIORITY_AGING_STEPS`` steps
and is admitted within (bands above it) x period steps plus a freed slot
(``engine.aging`` says why, and the bound). Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from .aging import Aging, band_of
from .costs import StepCosts
from .sequence import Sequence

# A sequence preempted by priority this many times is not a priority victim again until
# it has made PRIORITY_PROGRESS_TOKENS new tokens since the last (``may_preempt_for_priority``).
PRIORITY_PREEMPTION_CAP = 2
PRIORITY_PROGRESS_TOKENS = 16
# A decode token's weight over a prefill token's before the costs measured both: VTC's
# default (w_q = 2 w_p); measured, it is their ratio (per token of a prefill pass, per
# row of a decode pass at the step's batch), within DECODE_WEIGHT_BOUNDS.
DEFAULT_DECODE_WEIGHT = 2.0
DECODE_WEIGHT_BOUNDS = (1.0, 16.0)


class FairShare:
    """The tenants' virtual token counters (VTC). The stepping thread only.

    ``decode_weight``: a decode token's weight, fixed (a test's, or an operator's who
    wants VTC's own); None: ``DEFAULT_DECODE_WEIGHT`` until the costs measure it.
    """

    def __init__(self, decode_weight: float | None = None) -> None:
        self.counters: dict[str, float] = {}
        self.fixed = decode_weight is not None
        self.decode_weight = DEFAULT_DECODE_WEIGHT if decode_weight is None else decode_weight

    def counter(self, tenant: str) -> float:
        return self.counters.get(tenant, 0.0)

    def arrive(self, tenant: str, active: set[str]) -> None:
        """``tenant`` submits while the tenants ``active`` have work in the engine: if it
        had none, lift its counter to their least (no banked credit); nobody active:
        forget every counter."""
        if tenant in active:
            return
        if not active:
            self.counters.clear()
            return
        floor = min(self.counter(t) for t in active)
        self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def charge(self, tenant: str, prefill_tokens: int = 0, decode_tokens: int = 0) -> None:
        """Work done (or, a prompt at admission, committed to) for ``tenant``."""
        work = prefill_tokens + self.decode_weight * decode_tokens
        if work:
            self.counters[tenant] = self.counter(tenant) + work

    def weigh(self, costs: StepCosts, decode_rows: int) -> None:
        """Take the decode weight from the measured costs at ``decode_rows`` rows: a decode
        row's share of its pass over a prefill pass's ms per token (kept if unmeasured)."""
        if self.fixed:
            return
        line, decode = costs.prefill_line(), costs.decode_ms(max(decode_rows, 1))
        if line is None or decode is None or line[1] <= 0:
            return
        low, high = DECODE_WEIGHT_BOUNDS
        self.decode_weight = min(max(decode / max(decode_rows, 1) / line[1], low), high)


def ordered_waiting(waiting: Iterable[Sequence], fair: FairShare, aging: Aging | None = None,
                    running: Iterable[Sequence] = ()) -> tuple[list[Sequence], dict[Sequence, int]]:
    """The waiting sequences in the queue's order (stably): band, tenant's counter,
    started first, a fresh one's deadline, arrival, then each band head that ``aging``
    lifts moved up to the band it has risen to, first in it; and those lifts (head ->
    band). Reads only (see the module docstring)."""

    def key(seq: Sequence) -> tuple[int, float, bool, float]:
        request = seq.request
        fresh = not seq.generated_ids
        deadline = request.ttft_deadline if fresh else None
        return (request.priority, fair.counter(request.tenant), fresh,
                math.inf if deadline is None else deadline)

    ordered = sorted(waiting, key=key)
    lifted = aging.lifts(ordered, running) if aging is not None and ordered else {}
    if lifted:
        ordered.sort(key=lambda s: (lifted.get(s, s.request.priority), s not in lifted))
    return ordered, lifted


def order_waiting(waiting: deque[Sequence], fair: FairShare, aging: Aging | None = None,
                  running: Iterable[Sequence] = ()) -> dict[Sequence, int]:
    """Sort the waiting queue in place (``ordered_waiting``); the heads aging lifts."""
    ordered, lifted = ordered_waiting(waiting, fair, aging, running)
    waiting.clear()
    waiting.extend(ordered)
    return lifted


def lowest_band_youngest(running: Iterable[Sequence]) -> Sequence:
    """The sequence of the lowest band it runs at (the greatest ``band_of``) admitted
    last (``running`` in admission order): the victim of an exhausted pool, as of a
    band (all one band: the newest)."""
    return max(reversed(list(running)), key=band_of)


def priority_victim(running: Iterable[Sequence], head: Sequence) -> Sequence | None:
    """The running sequence to preempt for ``head``: the youngest of the lowest band
    running below ``head``'s own band (not one aging lifts it to), among those under the
    cap (or past it with progress made: ``may_preempt_for_priority``); None if none."""
    band = head.request.priority
    under = [s for s in running if band_of(s) > band and may_preempt_for_priority(s)]
    return lowest_band_youngest(under) if under else None


def may_preempt_for_priority(seq: Sequence) -> bool:
    """Whether ``seq`` may be preempted for a higher band (the floor of progress, once
    running: under the cap, or past it with ``PRIORITY_PROGRESS_TOKENS`` new tokens made
    since its last priority preemption)."""
    return (seq.num_priority_preemptions < PRIORITY_PREEMPTION_CAP
            or len(seq.generated_ids) - seq.generated_at_priority_preemption
            >= PRIORITY_PROGRESS_TOKENS)


@dataclass
class BandStatistics:
    """Per band (priority value): admissions and their queue wait, preemptions suffered."""

    admitted: dict[int, int] = field(default_factory=dict)
    wait_s: dict[int, float] = field(default_factory=dict)  # summed over first admissions
    preempted: dict[int, int] = field(default_factory=dict)  # any cause
    preempted_by_priority: dict[int, int] = field(default_factory=dict)
    # Every admission (a readmission too): the most steps one waited since it last
    # entered the queue (the floor of progress, measured), and those lifted by aging.
    longest_wait_steps: dict[int, int] = field(default_factory=dict)
    aged: dict[int, int] = field(default_factory=dict)

    def admit(self, band: int, waited_s: float) -> None:
        self.admitted[band] = self.admitted.get(band, 0) + 1
        self.wait_s[band] = self.wait_s.get(band, 0.0) + waited_s

    def left_queue(self, band: int, waited_steps: int, aged: bool) -> None:
        """Any admission of ``band``'s: its wait in steps, and whether aging lifted it."""
        self.longest_wait_steps[band] = max(self.longest_wait_steps.get(band, 0), waited_steps)
        if aged:
            self.aged[band] = self.aged.get(band, 0) + 1

    def preempt(self, band: int, by_priority: bool) -> None:
        self.preempted[band] = self.preempted.get(band, 0) + 1
        if by_priority:
            self.preempted_by_priority[band] = self.preempted_by_priority.get(band, 0) + 1

    def mean_wait_ms(self) -> tuple[tuple[int, float], ...]:
        return tuple((b, 1000 * self.wait_s[b] / n) for b, n in sorted(self.admitted.items()))


def waiting_by_band(waiting: Iterable[Sequence]) -> tuple[tuple[int, int], ...]:
    counts: dict[int, int] = {}
    for seq in waiting:
        counts[seq.request.priority] = counts.get(seq.request.priority, 0) + 1
    return tuple(sorted(counts.items()))
