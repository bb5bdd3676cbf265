"""How long until a request submitted now gets its first token: ``Engine.estimate_ttft_ms``.

The deadline gate (``streams``) refuses at once a request whose ``deadline_ms`` this
estimate says cannot be met, so it must be cheap, callable from any thread while a
step runs, and honest about what a busy server adds. It models what will happen from
now on with the measured step costs (``costs.StepCosts``):

* the step in flight ends first (as long as the last step took);
* then every prompt token queued ahead of this request, and its own, is prefilled, at
  most a step's prefill budget a step, each step also decoding the sequences that decode
  now; a step costs its passes, or the period between step starts measured while
  sequences ran, if that is longer (``step_timing``: the caller's own work between steps
  counts);
* if every batch slot is taken, the decode steps until one frees are added
  (``slot_wait_steps``); a wait for blocks is not in it.

With bands (``engine.priority``), for a request of ``priority`` p: the waiting sequences
of a lower band (a greater priority) are not ahead of it (they are admitted after it),
and every running one of a lower band that may still be preempted by priority is a slot
it can take, one a step (preemption in view): its deadline is judged by the work of its
own band and above. All in one band, the estimate is as above. Aging (``engine.aging``)
makes a lower band's head work ahead of it once lifted to its band or above: the estimate
counts such a head ahead, and also one its band's clock would lift within the estimate's
own steps (the estimate is made again with those; a second lift needs another whole
period, long against any wait a deadline can ask for). A band lower than the newcomer's
running at a band aging lifted it to is a victim only if that band is still lower.

It reads the scheduler's state as the last step boundary left it (``Boundary``, taken
by the stepping thread and replaced whole), and the inbox, which is thread-safe.
"""

from __future__ import annotations

from dataclasses import dataclass

from .aging import PRIORITY_AGING_STEPS, band_of, risen_band
from .priority import may_preempt_for_priority, ordered_waiting
from .scheduler import Scheduler
from .step_timing import StepTiming


@dataclass(frozen=True, slots=True)
class Boundary:
    """What the estimate reads of the scheduler, at a step boundary."""

    to_prefill: int  # positions to prefill of every waiting and admitted sequence
    decoding: int  # sequences that decode in a step
    queued: int  # waiting sequences
    steps_left: tuple[int, ...]  # tokens each running sequence may still make, ascending
    # Prefix cache: the identities of the full blocks that the admitted and the waiting
    # will have computed (a newcomer waits for them and shares them: none to compute).
    ahead: frozenset[bytes] = frozenset()
    # Bands: (priority, positions to prefill) of each waiting sequence but the bands'
    # heads; the bands the running that a higher band may still preempt run at
    # (``priority_victim``). Aging (``engine.aging``): each band's head as (its band, steps
    # its band was passed over, positions to prefill), the bands present, the period.
    waiting_bands: tuple[tuple[int, int], ...] = ()
    preemptible: tuple[int, ...] = ()
    heads: tuple[tuple[int, int, int], ...] = ()
    present: frozenset[int] = frozenset()
    aging_period: int = PRIORITY_AGING_STEPS

    @classmethod
    def of(cls, scheduler: Scheduler) -> Boundary:
        """Take it now (the stepping thread, between steps). A waiting sequence computes
        neither its cached prefix nor what those ahead of it compute (``waits_for``)."""
        prefix = scheduler.prefix
        ahead = prefix.in_flight(scheduler.running.values())
        shared = 0
        for seq in scheduler.waiting:
            shared += prefix.expected_hit_tokens(seq, ahead)
            ahead.update(prefix.prefill_digests(seq))
        aging, running = scheduler.residency.aging, scheduler.running.values()
        ordered, _ = ordered_waiting(scheduler.waiting, scheduler.residency.fair)
        firsts = {s.request.priority: s for s in reversed(ordered)}  # each band's head
        heads = set(firsts.values())
        return cls(
            to_prefill=scheduler.prompt_tokens_to_prefill() - shared,
            decoding=scheduler.num_decoding,
            queued=len(scheduler.waiting),
            steps_left=tuple(sorted(s.request.max_new_tokens - len(s.generated_ids)
                                    for s in scheduler.running.values())),
            ahead=frozenset(ahead),
            waiting_bands=tuple((s.request.priority, s.num_to_cache) for s in scheduler.waiting
                                if s not in heads),
            preemptible=tuple(band_of(s) for s in running if may_preempt_for_priority(s)),
            heads=tuple((band, aging.passed_over.get(band, 0), s.num_to_cache)
                        for band, s in sorted(firsts.items())),
            present=frozenset({s.request.priority for s in scheduler.waiting}
                              | {band_of(s) for s in running}),
            aging_period=aging.period,
        )


class TtftEstimator:
    """The estimate over one scheduler and its step clock (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, timing: StepTiming) -> None:
        self._scheduler = scheduler
        self._timing = timing
        self._boundary = Boundary.of(scheduler)

    @property
    def ahead(self) -> frozenset[bytes]:
        """The blocks the sequences in the engine will have computed (``Boundary``)."""
        return self._boundary.ahead

    def observe_boundary(self) -> None:
        """The stepping thread is at a step boundary: take the scheduler's state."""
        self._boundary = Boundary.of(self._scheduler)

    def estimate_ms(self, prompt_tokens: int, priority: int = 0) -> float | None:
        """Milliseconds until a request of ``prompt_tokens`` in band ``priority``
        submitted now gets its first token; None before any step cost was measured. Any
        thread. With lower bands' heads that aging may lift to its band meanwhile: the
        estimate again, counting those lifted within the first estimate's steps."""
        first = self._estimate(prompt_tokens, priority, horizon=0)
        if first is None or not self._boundary.heads:
            return None if first is None else first[0]
        again = self._estimate(prompt_tokens, priority, horizon=first[1])
        return None if again is None else again[0]

    def _estimate(self, prompt_tokens: int, priority: int,
                  horizon: int) -> tuple[float, int] | None:
        """The estimate in ms and in steps, the band heads aged ``horizon`` steps more."""
        scheduler, at = self._scheduler, self._boundary
        costs = scheduler.costs
        line = costs.step_line(at.decoding, scheduler.mixed_step)
        decode = costs.decode_ms(at.decoding)
        if line is None or decode is None:
            return None
        fixed, per_token = line  # a mixed step's fixed: only what it adds to the decode
        behind, behind_count = self.behind(at, priority, horizon)  # admitted later
        ahead = max(at.to_prefill - behind, 0) + scheduler.inbox.prompt_tokens() + prompt_tokens
        steps = -(-ahead // max(scheduler.prefill_budget(at.decoding), 1))
        in_flight = self._timing.last_step_ms or 0.0
        period = self._timing.busy_period_ms or 0.0  # a step as paced, if longer
        wait_steps = self.slot_wait_steps(at, scheduler.inbox.submits(), priority, behind_count)
        ms = (in_flight + wait_steps * max(decode, period)
              + steps * max(decode + fixed, period) + per_token * ahead)
        return ms, 1 + wait_steps + steps

    @staticmethod
    def behind(at: Boundary, priority: int, horizon: int = 0) -> tuple[int, int]:
        """Positions and sequences waiting behind a request of band ``priority``: those
        of lower bands, but a band's head that aging lifts to ``priority`` or above within
        ``horizon`` steps (if every one of them passes it over: at most)."""
        present = at.present | {priority}
        heads = [(risen_band(band, over + horizon, present, at.aging_period), n)
                 for band, over, n in at.heads]
        later = [n for band, n in (*at.waiting_bands, *heads) if band > priority]
        return sum(later), len(later)

    def slot_wait_steps(self, at: Boundary, inbox_submits: int, priority: int = 0,
                        behind_count: int | None = None) -> int:
        """Decode steps until a batch slot frees for a request submitted now (0 if one is
        free): the k-th soonest end among the running sequences, k its place in the
        queue for slots, counting each as running to its max_new_tokens (an upper
        bound: eos ends one sooner), plus a round of the longest for each full batch
        queued ahead. With bands, only the waiting of its band and above (``behind``)
        queue ahead, and a preemptible running sequence of a lower band frees a slot a
        step."""
        left = at.steps_left
        if behind_count is None:
            behind_count = self.behind(at, priority)[1]
        k = at.queued - behind_count + inbox_submits + 1 - (
            self._scheduler.max_batch - len(left))
        if k <= 0 or not left:
            return 0
        victims = sum(band > priority for band in at.preemptible)
        if k <= victims:
            return k  # one preemption a step
        rounds, index = divmod(k - victims - 1, len(left))
        return victims + left[index] + rounds * left[-1]
