"""Stepping an engine in tests until it has nothing left to do (no torch here)."""

from __future__ import annotations

from engine import EngineEvent, TokenEvent
from engine.engine import Engine


def run_until_idle(engine: Engine, max_steps: int = 500) -> list[EngineEvent]:
    """Step ``engine`` while it has work; its events. Fails after ``max_steps`` steps."""
    events: list[EngineEvent] = []
    for _ in range(max_steps):
        if not engine.has_work():
            return events
        events += engine.step()
    raise AssertionError(f"the engine still has work after {max_steps} steps")


def tokens_by_request(events: list[EngineEvent]) -> dict[str, list[int]]:
    """Token ids per request, checking each index comes once and in order."""
    ids: dict[str, list[int]] = {}
    for event in events:
        if isinstance(event, TokenEvent):
            tokens = ids.setdefault(event.request_id, [])
            assert event.index == len(tokens), event
            tokens.append(event.token_id)
    return ids
