"""``/stats``: the engine's, the hub's and the resume registry's statistics, flat.

Each is a statistics dataclass flattened (``dataclasses.asdict``), each field under its
own name but those below, renamed where a name alone would be unclear among the others;
a new statistics field shows up in /stats by itself. Before the model is loaded there
are no statistics yet: every field is there, None (the engine's) or 0 (the others').
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import engine
import streams
from streams.resume import ResumeRegistry, ResumeStatistics

from .loading import ServingEngine

_HUB_KEYS = {"state": "hub_state", "waiting": "streams_waiting", "steps": "hub_steps"}
_RESUME_KEYS = {"streams": "resumable_streams", "detached": "resumable_detached",
                "log_bytes": "resume_log_bytes", "detached_bytes": "resume_detached_bytes",
                "expiries": "resume_expiries", "overflows": "resume_overflows",
                "cancels": "resume_cancels", "failovers": "resume_failovers",
                "disowned": "resume_disowned", "handed_over": "resume_handed_over",
                "store_pending": "resume_store_pending",
                "store_batches": "resume_store_batches",
                "store_commands": "resume_store_commands",
                "store_failed_batches": "resume_store_failed_batches",
                "spec_rejected": "resume_spec_rejected",
                "events_rejected": "resume_events_rejected",
                "remote_cancels": "resume_remote_cancels",
                "store_refused": "resume_store_refused",
                "store_dropped": "resume_store_dropped",
                "store_cut_streams": "resume_store_cut_streams",
                "store_read_errors": "resume_store_read_errors"}


def statistics_fields(
    eng: ServingEngine | None, hub: streams.Hub | None, registry: ResumeRegistry | None
) -> dict[str, Any]:
    """The three statistics as /stats keys (see the module docstring)."""
    result = _engine_fields(eng)
    result.update(_hub_fields(hub))
    result.update(_resume_fields(registry))
    return result


def _flat(stats: Any, kind: type, keys: Mapping[str, str], absent: object) -> dict[str, Any]:
    """``stats`` (a dataclass of type ``kind``, or None) as /stats keys; enums as their
    values; every field ``absent`` when there is none yet."""
    if stats is None:
        return {keys.get(f.name, f.name): absent for f in dataclasses.fields(kind)}
    return {keys.get(name, name): getattr(value, "value", value)
            for name, value in dataclasses.asdict(stats).items()}


def _engine_fields(eng: ServingEngine | None) -> dict[str, Any]:
    stats = eng.statistics() if eng is not None else None
    fields = _flat(stats, engine.EngineStatistics, {}, None)
    phases = getattr(eng, "start_phases_s", None)  # engine.Engine's: what its start took
    fields["start_phases_s"] = dict(phases) if isinstance(phases, dict) else None
    # Which requests the last step prefilled is the scope's (per key); any key may read
    # /stats, so other keys' request ids stay out of it (docs/security.md).
    fields.pop("last_step_prefill_ids", None)
    return fields


def _hub_fields(hub: streams.Hub | None) -> dict[str, Any]:
    fields = _flat(hub.statistics() if hub is not None else None, streams.HubStatistics,
                   _HUB_KEYS, 0)
    if hub is None:
        fields.update(hub_state=None, last_error=None)
    return fields


def _resume_fields(registry: ResumeRegistry | None) -> dict[str, Any]:
    stats = registry.statistics() if registry is not None else None
    return _flat(stats, ResumeStatistics, _RESUME_KEYS, 0)
