"""Aging: the floor of progress under strict bands (``engine.priority``), counted in steps.

Theory of operation. Bands are strict: a lower band waits while higher bands keep the
batch or the pool full, and without a floor it can wait forever (a preempted stream too:
the preemption cap, ``PRIORITY_PREEMPTION_CAP``, keeps it from being preempted again once
readmitted, but says nothing of when it is readmitted). Aging is the floor. Each band
that has sequences waiting has a clock, ``Aging.passed_over``: the engine steps since the
band last admitted a sequence in which a higher band was in the engine (running, holding
a slot, or waiting to be admitted before it). Every ``period`` of them, the band's head
(its first waiting sequence in the queue's order: ``priority.order_waiting``) is served
one band higher, counting the bands present in the engine (running or waiting) above
its own, never above the highest of them; it goes first within the band it has risen to
(it has waited longest), and once admitted it keeps that band while it runs
(``Sequence.aged_band``). Its band's clock then starts again for the next head.

Why these choices:

* Steps, not seconds: deterministic, testable, and a step is the unit a higher band's
  service is made of (a token per running stream).
* Only steps in which a higher band was present count: a band that waits for its own
  streams to finish (a deep backlog of one band, no higher traffic) is not starved by priority and
  must not age; otherwise it would sit at the top, already aged, the moment an
  interactive request arrived.
* Only a band's head ages, and the clock restarts at each of the band's admissions: at
  most one sequence per lower band is ever lifted at a time, so a higher band loses at
  most one place in line per lower band per period (a deep flex backlog does not age as
  a whole and drown the interactive band).
* Bands present, not band values: the API numbers bands -10 to 10 with gaps (the
  ``priority`` tier -10, ``default`` 0, ``flex`` 5), so rising by one value would make
  the floor depend on the numbering (flex behind the priority tier: 15 periods); rising
  by one band present makes it the number of higher bands actually competing.
* The aged band is kept while it runs: else a sequence admitted by aging would be the
  lowest band's youngest, the very next priority victim of the band it overtook, and
  thrash. It can still be preempted by a band above the one it runs at (under the cap),
  and for blocks (an exhausted pool's victim is the lowest running band's youngest, the
  aged band counting). Preempted, it waits in its own band again.
* Aging moves a sequence up the queue; it does not give it a higher band's power to
  preempt (``priority.priority_victim`` judges a waiting sequence by its own band): a
  lifted head takes the next batch slot that frees, so aging never causes a preemption
  of its own, and a higher band behind it still preempts as before (the slot it frees may
  go to the lifted head first: one extra step for that higher band).

The bound: a band with ``k`` bands present above it admits its head once it has been
passed over ``k * period`` steps, plus the steps until a slot frees (the fewest tokens
any running sequence has left to make, unless all of them are paused by slow readers)
and until enough blocks are free for it; the heads of other bands lifted as high and
lower in their own band go before it, one slot each. A band that waited less than a
period is never reordered: bands are strict for it. ``PRIORITY_AGING_STEPS`` is 200: an
interactive request waits a few steps (one preemption, its prefill), short against a
period, so at most one lifted head per lower band can come before it in that wait; and
200 steps is about twice the longest answer of ``tools.lab priority``'s flood, so a band
whose own streams hold slots admits well within a period while a higher band is served
beside it; on a GPU step of 20 to 50 ms a period is 4 to 10 s. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from .sequence import Sequence

# Steps (with a higher band present) a band's head waits per band it rises.
PRIORITY_AGING_STEPS = 200


def band_of(seq: Sequence) -> int:
    """The band a sequence is served at: its request's, or the one aging admitted it at
    (kept while it runs)."""
    return seq.request.priority if seq.aged_band is None else seq.aged_band


def risen_band(band: int, passed_over: int, present: Iterable[int], period: int) -> int:
    """The band a head of ``band`` whose band was passed over ``passed_over`` steps is
    served at: one band of ``present`` above ``band`` per ``period``, at most the
    highest of them."""
    rises = passed_over // period
    above = sorted({b for b in present if b < band})  # highest (least) first
    if not rises or not above:
        return band
    return above[max(len(above) - rises, 0)]


class Aging:
    """The bands' clocks of steps passed over, and the heads they lift. The stepping
    thread only (the TTFT boundary reads ``passed_over`` there too).

    ``period``: steps per band risen (``PRIORITY_AGING_STEPS``; a test's may be short).
    """

    def __init__(self, period: int = PRIORITY_AGING_STEPS) -> None:
        if period < 1:
            raise ValueError(f"the aging period must be at least 1 step, got {period}")
        self.period = period
        self.steps = 0  # steps taken (``tick``): what a queue wait is counted in
        self.passed_over: dict[int, int] = {}  # band with waiting -> steps passed over

    def tick(self, waiting: Iterable[Sequence], running: Iterable[Sequence]) -> None:
        """A step begins: each band waiting gains a step if a higher band is in the
        engine (running, or waiting to be admitted before it); a band that waits no
        more is forgotten."""
        self.steps += 1
        bands = {s.request.priority for s in waiting}
        highest = min(bands | {band_of(s) for s in running}, default=None)
        self.passed_over = {
            band: self.passed_over.get(band, 0) + (highest is not None and highest < band)
            for band in bands}

    def admitted(self, seq: Sequence) -> None:
        """``seq`` left the queue for a slot: its band's clock starts again."""
        if seq.request.priority in self.passed_over:
            self.passed_over[seq.request.priority] = 0

    def lifts(self, ordered: list[Sequence], running: Iterable[Sequence]) -> dict[Sequence, int]:
        """The heads of ``ordered`` (the queue in its strict order) that are served
        higher now, and the band each is served at."""
        present = {s.request.priority for s in ordered} | {band_of(s) for s in running}
        lifted: dict[Sequence, int] = {}
        seen: set[int] = set()
        for seq in ordered:
            band = seq.request.priority
            if band in seen:
                continue
            seen.add(band)
            risen = risen_band(band, self.passed_over.get(band, 0), present, self.period)
            if risen < band:
                lifted[seq] = risen
        return lifted
