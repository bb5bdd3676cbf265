"""The band yielding: a step that carries a higher band's rows stays about as short as
those rows need, so an interactive stream is not slowed by a batch job.

Every row of a step waits for the whole step: a decode row's next token, and a prompt's
first token, come when the pass is done. So a lower band's work in a step carrying a
higher band's rows stretches the higher band's inter-token gaps and its TTFT: in
``tools.lab priority`` a flex flood's prompt chunks, prefilled beside interactive
streams, made their inter-token gap p95 3.8 times an idle server's. Two rules, for a step
whose highest band present (``top``: decoding or prefilling) has lower bands beside it:

* **a step with a higher band's prompt** (its first token waits for it): the higher
  band's rows are planned first, with the whole budget, and their cost alone by the
  measured ``StepCosts`` is the reference; the lower bands' decode rows ride while the
  step stays within ``1 + LOWER_BAND_STEP_SHARE`` of it (in turn: the one that rode such
  a step longest ago first; at least one), their prompts wait for the next step;
* **a step of decode rows only**: every decode row rides (on the embedded model a pass of
  8 rows costs about what an idle server's step with a prompt does, so the gaps stay
  near the idle server's; limiting them too held the flood's rows in their slots so long
  that the interactive band ran out of rows it may preempt, ``PRIORITY_PREEMPTION_CAP``:
  TTFT p95 14.6 times idle), and the lower bands' prompts add at most
  ``LOWER_BAND_STEP_SHARE`` of the decode pass by the costs, never under
  ``LOWER_BAND_FLOOR_TOKENS``: the floor of progress for a flood's prompts and for a stream
  preempted for the higher band, recomputing.

A higher band's prompt arrives now and then, so the lower band loses a step's decode rows
now and then and a prompt chunk's share in the others; when the higher band is idle the
lower band is the top band and keeps the whole step (the flood's rate while the
interactive key is idle is its rate alone: ``flood_idle_share``).

The reference is a lower estimate where the costs have only seen bigger batches (a flood
keeps the batch full, so one higher row alone may never have run: ``decode_ms_low``); the
lower band's rows are priced by the costs as they are, so an unseen batch size is not
assumed cheap, and once it has run it is known. Before the costs are measured (the first
steps) every decode row runs and a lower band's prompts get
``LOWER_BAND_UNMEASURED_SHARE`` of the budget. Which rows ride in a step never changes a
row's tokens: each row's bits are its solo run's in any batch
(``engine.batch_invariance``); only when they come changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .costs import StepCosts
from .sequence import Sequence

# How much a lower band's rows may lengthen a step carrying a higher band's, as a share of
# what the higher band's rows cost alone (measured: ``tools.lab priority``, docs/engine.md).
LOWER_BAND_STEP_SHARE = 0.1
# The least prompt tokens the lower bands get in a step of decode rows only: the floor of
# progress of their prompts (on the embedded model, 16 tokens added a third to an 8-row
# decode pass, more than the share; 8 add a sixth).
LOWER_BAND_FLOOR_TOKENS = 8
# A lower band's prompt tokens beside a higher band's rows before the costs are measured.
LOWER_BAND_UNMEASURED_SHARE = 0.125


@dataclass(frozen=True, slots=True)
class BandYield:
    """What a step's lower bands may add to it, by the measured costs (module docstring).

    Args:
        costs: the engine's measured step costs.
        mixed: whether the step's prefill and decode share one pass (``Scheduler.mixed_step``).
        max_prefill_tokens: the engine's prefill budget (the unmeasured share is of it).
    """

    costs: StepCosts
    mixed: bool
    max_prefill_tokens: int

    def limit_ms(self, higher_rows: int, higher_cost: int) -> float | None:
        """The longest the step may take: ``1 + LOWER_BAND_STEP_SHARE`` times what the
        higher band's ``higher_rows`` decode rows and prompt tokens counting
        ``higher_cost`` take alone; None before the costs can say."""
        decode = self.costs.decode_ms_low(higher_rows)  # never overestimated: see there
        line = self.costs.step_line(higher_rows, self.mixed) if higher_cost else (0.0, 0.0)
        if decode is None or line is None or not (higher_rows or higher_cost):
            return None
        return (decode + line[0] + line[1] * higher_cost) * (1 + LOWER_BAND_STEP_SHARE)

    def decode_rows(self, lower: list[Sequence], higher_rows: int, higher_cost: int,
                    limit: float | None, waited: Callable[[Sequence], int]) -> list[Sequence]:
        """The lower band's decode rows that ride in the step: all of them before the
        costs can say, else the ones that waited longest (``waited``: larger first) while
        the step stays within ``limit``, and at least one (the floor of progress)."""
        if limit is None or not lower:
            return lower
        ranked = sorted(lower, key=waited, reverse=True)
        rows = 1
        while rows < len(ranked):
            cost = self.costs.step_ms(higher_rows + rows + 1, higher_cost, self.mixed)
            if cost is None or cost > limit:
                break
            rows += 1
        return ranked[:rows]

    def prompt_budget(self, decode_rows: int, budget: int) -> int:
        """Prompt tokens (cost tokens with a step target) the lower bands may prefill in
        a step of ``decode_rows`` decode rows and no higher band's prompt, of the step's
        ``budget``: what adds at most ``LOWER_BAND_STEP_SHARE`` of the decode pass by the
        costs, the unmeasured share before they can say; never under
        ``LOWER_BAND_FLOOR_TOKENS`` (nor over ``budget``)."""
        decode = self.costs.decode_ms(decode_rows)
        fits = None if not decode else self.costs.prefill_tokens_within(
            decode * (1 + LOWER_BAND_STEP_SHARE), decode_rows, self.mixed)
        if fits is None:  # nothing measured yet
            fits = int(self.max_prefill_tokens * LOWER_BAND_UNMEASURED_SHARE)
        return min(budget, max(fits, LOWER_BAND_FLOOR_TOKENS))
