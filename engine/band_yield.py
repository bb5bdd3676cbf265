"""The band yielding: a step that carries a higher band's rows stays about as short as
those rows alone would make it, so an interactive stream is not slowed by a batch job.

Every row of a step waits for the whole step: a decode row's next token, and a prompt's
first token, come when the slowest part of the pass is done. So a lower band's rows in
a step carrying a higher band's rows stretch the higher band's inter-token gaps and its
TTFT. On the embedded model (2 threads) a decode pass of 8 rows took twice one of 1 row,
and a flex flood's prompt chunks came on top: in ``tools.lab priority`` an interactive
stream beside a flood had its inter-token gap p95 at 3.8 times an idle server's.

The rule, for a step whose highest band present (``top``: decoding or prefilling) has
lower bands beside it: the higher band's own rows (``top`` and above) are planned first,
with the whole budget; their cost by the measured ``StepCosts`` is the step's reference;
the lower bands then ride in it while the step stays within ``1 + LOWER_BAND_STEP_SHARE``
of the reference: their decode rows first, the ones that waited longest (fewest recent
plans) before others, then their prompts within what is left. The bound of its cost to
the lower bands, the floor of progress: at least one lower decode row in every such step
(in rotation, so each row waits at most as many steps as the lower band has decode rows)
and at least ``MIN_PREFILL_TOKENS`` of their prompts when a step has room for any, so a
flood (and a stream preempted for the higher band, recomputing) always progresses. When
the higher band is idle the lower band is the top band and keeps the whole step: the
flood's rate while the interactive key is idle is its rate alone (``flood_idle_share``).

The reference is a lower estimate where the costs have only seen bigger batches (a flood
keeps the batch full, so one higher row alone may never have run: ``decode_ms_low``); the
lower band's rows are priced by the costs as they are, so an unseen batch size is not
assumed cheap, and once it has run it is known. Before the costs are measured (the first
steps) nothing is known to compare with: every decode row runs and a lower band's prompts
get ``LOWER_BAND_UNMEASURED_SHARE`` of the budget. Which rows ride in a step never
changes a row's tokens: each row's bits are its solo run's in any batch
(``engine.batch_invariance``); only when they come changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .costs import StepCosts
from .sequence import Sequence

# How much a lower band's rows may lengthen a step carrying a higher band's, as a share of
# what the higher band's rows cost alone (measured: ``tools.lab priority``, docs/engine.md).
LOWER_BAND_STEP_SHARE = 0.25
# A lower band's prompt tokens beside a higher band's rows before the costs are measured.
LOWER_BAND_UNMEASURED_SHARE = 0.125


@dataclass(frozen=True, slots=True)
class BandYield:
    """What a step's lower bands may add to it, by the measured costs (module docstring).

    Args:
        costs: the engine's measured step costs.
        mixed: whether the step's prefill and decode share one pass (``Scheduler.mixed_step``).
        max_prefill_tokens: the engine's prefill budget (the unmeasured share is of it).
        floor_tokens: the least prompt tokens a lower band gets in a step with room.
    """

    costs: StepCosts
    mixed: bool
    max_prefill_tokens: int
    floor_tokens: int

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

    def prompt_budget(self, decode_rows: int, higher_cost: int, limit: float | None,
                      room: int) -> int:
        """Prompt tokens (cost tokens with a step target) the lower bands may prefill in
        a step of ``decode_rows`` decode rows whose higher band's prompts count
        ``higher_cost``, of ``room`` left in the step's budget: what keeps the step
        within ``limit``, the unmeasured share before the costs can say; never under
        ``floor_tokens`` (nor over ``room``)."""
        if limit is None:
            within = int(self.max_prefill_tokens * LOWER_BAND_UNMEASURED_SHARE)
        else:
            fits = self.costs.prefill_tokens_within(limit, decode_rows, self.mixed)
            within = 0 if fits is None else fits - higher_cost
        return max(min(room, max(within, self.floor_tokens)), 0)
