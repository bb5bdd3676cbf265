"""Reservation admission, kept for comparison: the lab's device, never the service's.

Before issue 14 a sequence reserved every cache block it could ever need (prompt plus
``max_new_tokens``) when it was admitted, so it never ran out and was never preempted,
and a request asking for far more than it used held its blocks idle. The product now
takes blocks as sequences write (``engine.admission.OnDemandAdmission``); the
``capacity`` experiment still measures the old scheme beside it at the same memory, so
the scheme lives here and reaches an engine only through its public seam,
``Engine(admission=...)`` (``engine.load_engine(..., admission=...)``).

The lab's server picks it with ``STREAMSCOPE_LAB_KV_ADMISSION=reserve`` (``_settings.py``;
``create_lab_app`` then loads its engine with ``load_reserving_engine``); the service has
no such setting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the lab's server passes them; importing this module loads no app
    from app.runtime import ServingEngine
    from app.settings_engine import EngineSettings
    from engine.sequence import Sequence


class ReservationAdmission:
    """Every position a sequence can need, at admission: never preempted."""

    name = "reserve"

    def positions_at_admission(self, seq: Sequence) -> int:
        return seq.max_tokens


RESERVATION = ReservationAdmission()


def load_reserving_engine(settings: EngineSettings) -> ServingEngine:
    """``app.runtime.load_engine_from_settings`` with reservation admission: the same
    model, batch, prefill and cache settings (loads the model: imports torch)."""
    from app.runtime import load_engine_from_settings  # here: importing this loads no app

    return load_engine_from_settings(settings, admission=RESERVATION)
