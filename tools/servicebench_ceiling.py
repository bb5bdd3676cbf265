"""The ceiling of a ``tools.servicebench`` level: the engine alone, stepped in the
benchmark's own process, with no server, socket or event loop in the way.

Why a module of its own: a share of the ceiling means something only if the ceiling is
taken in the same run, on the same model and engine settings as the servers, and the way
it is taken (N / the mean step while all N decode; for the simulated runner, N / its
pass, the engine alone checking what the bookkeeping adds) is a method of its own,
apart from driving servers over HTTP.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from app.settings import Settings

# The ceilings' engines, as the service's (and the peer's, tools/peers/uvicorn_starlette.py); the
# short prompts fill no block, so the cache has nothing to share here: only its cost.
PREFIX_CACHE = Settings().prefix_cache


def engine_alone(engine: Any, bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """Submit every body, step to the end; the mean step while all N decode (after every
    first token, before the first finish) and the whole run's tokens/s."""
    from engine import GenerationRequest, SamplingParams, TokenEvent

    n = len(bodies)
    for i, body in enumerate(bodies):
        engine.submit(GenerationRequest(f"alone-{i}", body["prompt"], body["max_new_tokens"],
                                        sampling=SamplingParams(ignore_eos=True)))
    started = time.perf_counter()
    first: set[str] = set()
    steady: list[float] = []
    made = steps = 0
    while engine.has_work():
        began = time.perf_counter()
        events = engine.step()
        took = time.perf_counter() - began
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        made, steps = made + len(tokens), steps + 1
        if len(first) == n and len(tokens) == n:
            steady.append(took)
        first.update(e.request_id for e in tokens if e.index == 0)
    whole_s = time.perf_counter() - started
    step_s = statistics.fmean(steady) if steady else float("nan")
    return {"tokens_per_s": round(n / step_s, 1), "step_ms": round(step_s * 1000, 3),
            "steady_steps": len(steady), "steps": steps, "tokens": made,
            "whole_run_tokens_per_s": round(made / whole_s, 1)}


def measure_ceiling(kind: str, loaded: Any, bodies: list[dict[str, Any]],
                    sim_step_ms: float) -> dict[str, Any]:
    """The level's ceiling (``tools.servicebench``'s docstring) and the engine alone that
    gives or checks it."""
    from engine.engine import Engine
    from tools.simulated import SimulatedRunner, simulated_engine

    n = len(bodies)
    if kind == "tiny":
        blocks = n * math.ceil(loaded.max_context / 16) + 1
        alone = engine_alone(Engine(loaded, max_batch=n, num_blocks=blocks, block_size=16,
                                    prefix_cache=PREFIX_CACHE), bodies)
        return {"tokens_per_s": alone["tokens_per_s"], "step_ms": alone["step_ms"],
                "method": "engine alone: N / mean step while all N decode",
                "engine_alone": alone}
    engine = simulated_engine(loaded, step_ms=sim_step_ms, max_batch=n,
                              prefix_cache=PREFIX_CACHE)
    alone = engine_alone(engine, bodies)
    runner = engine.runner
    assert isinstance(runner, SimulatedRunner)
    pass_ms = runner.pass_s / max(runner.passes, 1) * 1000
    alone["bookkeeping_ms_per_step"] = round(alone["step_ms"] - pass_ms, 3)
    alone["share_of_ceiling"] = round(alone["tokens_per_s"] / (n * 1000 / sim_step_ms), 4)
    return {"tokens_per_s": round(n * 1000 / sim_step_ms, 1), "step_ms": sim_step_ms,
            "method": "N / sim_step_ms", "engine_alone": alone}
