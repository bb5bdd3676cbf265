"""How much of the KV cache a sequence takes when it is admitted: the engine's seam.

The residency admits a waiting sequence when its table's blocks fit (beside the
watermark while others run); how many positions that table covers at admission is the
policy's to say. The product's policy is ``OnDemandAdmission``: the positions its
prefill writes (prompt, or prompt plus tokens for a recompute), then a block more each
time decoding crosses into one, with preemption by recompute when none is free (see
``residency``). A policy that covers every position a sequence can ever need at once
(``seq.max_tokens``) never runs out while it runs, so it is never preempted: that
reservation is kept for comparison by the lab (``tools/lab/reservation.py``), which
passes it to ``Engine(admission=...)``; the service has no setting for it.
"""

from __future__ import annotations

from typing import Protocol

from .sequence import Sequence

# Blocks kept free at admission while others run, as a share of the pool: room for the
# running sequences to grow a while before a newcomer forces a preemption (vLLM's
# watermark is also 1%).
DEFAULT_WATERMARK = 0.01


class AdmissionPolicy(Protocol):
    """What the scheduler asks of an admission policy (pure Python, no state needed)."""

    name: str  # for reports and statistics: "on_demand", or the lab's own

    def positions_at_admission(self, seq: Sequence) -> int:
        """Positions the table of ``seq`` covers from admission: at least what its
        prefill writes (``seq.prefill_end``), at most ``seq.max_tokens``."""
        ...


class OnDemandAdmission:
    """Blocks as a sequence writes: its prefill's at admission, more as it decodes."""

    name = "on_demand"

    def positions_at_admission(self, seq: Sequence) -> int:
        return seq.prefill_end


ON_DEMAND = OnDemandAdmission()
