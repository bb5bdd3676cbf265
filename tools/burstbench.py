"""A burst of arrivals and a long prompt, in the engine itself: TTFT and gaps per setting.

``python -m tools.burstbench [--json FILE]`` loads the embedded model once and runs,
for each engine setting, one after another in the same process (so that they share
the machine's load), two scenarios with no HTTP in between (times are taken in the
stepping thread, when ``step()`` hands an event out):

* ``burst``: the experiments' 32 prompts arrive together at an idle engine, greedy,
  ``--burst-tokens`` new tokens each. Reported: TTFT p50/p99/max, the gaps between a
  stream's tokens (p50/p99/max), tokens/s over the whole burst, and its ratio to the
  bare decode ceiling measured first in the same run (32 / the median of decode steps
  with all 32 running, after one packed prefill; also the run's warm-up).
* ``long``: 16 streams decode; a prompt of ``--long-tokens`` tokens arrives. Reported:
  the running streams' gaps from its arrival to its first token (p50/p99/max), and
  its TTFT.

Settings: ``serial`` (one prefill pass per prompt, 256 prompt tokens a step: the
engine before issue 10, except that a long prompt is now chunked), ``whole`` (one
pass for every waiting prompt, whole: a 4096-token budget), ``budget-256`` (the
default), and ``step-target`` (``max_step_ms``: ``--step-ms``, or by default twice
the calibrated decode pass at batch 32).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine import EngineEvent, GenerationRequest, SamplingParams, TokenEvent
from engine.engine import Engine
from engine.model import LoadedModel, load_model
from tools.prompts import load_prompts

FIXED = SamplingParams(ignore_eos=True)
Options = dict[str, Any]


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)


class Recorder:
    """Times (s since ``t0``) at which each request's tokens came out of the engine."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.times: dict[str, list[float]] = {}

    def __call__(self, events: list[EngineEvent]) -> None:
        now = time.perf_counter() - self.t0
        for event in events:
            if isinstance(event, TokenEvent):
                self.times.setdefault(event.request_id, []).append(now)

    def step(self, engine: Engine) -> float:
        """One step; its duration in seconds."""
        started = time.perf_counter()
        self(engine.step(on_prefill=self))
        return time.perf_counter() - started


def _submit(engine: Engine, request_id: str, ids: list[int], max_new: int) -> None:
    engine.submit(GenerationRequest(request_id, "", max_new, sampling=FIXED,
                                    prompt_token_ids=tuple(ids)))


def burst(engine: Engine, prompts: list[list[int]], max_new: int) -> dict[str, float]:
    record = Recorder()
    for i, ids in enumerate(prompts):
        _submit(engine, f"b{i}", ids, max_new)
    while engine.has_work():
        record.step(engine)
    ttft = [t[0] for t in record.times.values()]
    gaps = [b - a for t in record.times.values() for a, b in itertools.pairwise(t)]
    makespan = max(t[-1] for t in record.times.values())
    tokens_per_s = sum(len(t) for t in record.times.values()) / makespan
    return {
        "ttft_p50": _pct(ttft, 0.5), "ttft_p99": _pct(ttft, 0.99), "ttft_max": _pct(ttft, 1),
        "gap_p50": _pct(gaps, 0.5), "gap_p99": _pct(gaps, 0.99), "gap_max": _pct(gaps, 1),
        "tokens_per_s": round(tokens_per_s, 1),
    }


def decode_ceiling(loaded: LoadedModel, prompts: list[list[int]], steps: int = 8) -> float:
    """Tokens/s of bare decode steps with every prompt running (32 / median step time).

    Also the run's warm-up: the first passes at each shape pay one-off costs."""
    engine = Engine(loaded, max_batch=len(prompts), num_blocks=1024, max_prefill_tokens=4096)
    for i, ids in enumerate(prompts):
        _submit(engine, f"c{i}", ids, steps + 2)
    engine.step()  # every prefill, in one pass
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    while engine.has_work():
        engine.step()
    return len(prompts) / statistics.median(times)


def long_prompt(
    engine: Engine, running: list[list[int]], long_ids: list[int]
) -> dict[str, float]:
    record = Recorder()
    for i, ids in enumerate(running):
        _submit(engine, f"r{i}", ids, 256)
    while len(record.times) < len(running):
        record.step(engine)
    for _ in range(2):
        record.step(engine)
    arrived = time.perf_counter() - record.t0
    _submit(engine, "long", long_ids, 2)
    while "long" not in record.times:
        record.step(engine)
    ttft = record.times["long"][0] - arrived
    gaps = [
        b - a for rid, t in record.times.items() if rid != "long"
        for a, b in itertools.pairwise(t) if b > arrived
    ]
    for i in range(len(running)):
        engine.cancel(f"r{i}")
    while engine.has_work():
        engine.step()
    return {"gap_p50": _pct(gaps, 0.5), "gap_p99": _pct(gaps, 0.99), "gap_max": _pct(gaps, 1),
            "long_ttft": round(ttft * 1000, 1), "long_prompt_tokens": len(long_ids)}


def settings(loaded: LoadedModel, step_ms: float | None) -> dict[str, Options]:
    if step_ms is None:
        probe = Engine(loaded, max_batch=32, max_step_ms=1000.0)  # calibrates
        decode = probe.costs.decode_ms(32)
        assert decode is not None
        step_ms = round(2 * decode)
    return {
        "serial": {"pack_prefill": False},
        "whole": {"max_prefill_tokens": 4096},
        "budget-256": {},
        "step-target": {"max_prefill_tokens": 4096, "max_step_ms": step_ms},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.burstbench", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--burst-tokens", type=int, default=16)
    parser.add_argument("--long-tokens", type=int, default=1000)
    parser.add_argument("--step-ms", type=float, default=None)
    parser.add_argument("--settings", nargs="+", default=None, help="a subset, by name")
    parser.add_argument("--scenarios", nargs="+", default=["burst", "long"])
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    loaded = load_model(args.model, "cpu")
    encode: Callable[[str], list[int]] = loaded.tokenizer.encode
    prompts = [encode(p) for p in load_prompts()]
    long_ids = [t for p in prompts for t in p][: args.long_tokens]
    ceiling = decode_ceiling(loaded, prompts)
    chosen = settings(loaded, args.step_ms)
    print(json.dumps({"decode_ceiling_tokens_per_s": round(ceiling, 1)}))
    rows = []
    for name, options in chosen.items():
        if args.settings and name not in args.settings:
            continue
        row: dict[str, Any] = {"setting": name, "options": options}
        for scenario in args.scenarios:
            engine = Engine(loaded, max_batch=32, num_blocks=1024, block_size=16, **options)
            if scenario == "burst":
                row["burst"] = burst(engine, prompts, args.burst_tokens)
                row["burst"]["of_ceiling"] = round(row["burst"]["tokens_per_s"] / ceiling, 3)
            else:
                row["long"] = long_prompt(engine, prompts[:16], long_ids)
        rows.append(row)
        print(json.dumps(row))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        summary = {"model": args.model, "burst_tokens": args.burst_tokens,
                   "long_tokens": len(long_ids),
                   "decode_ceiling_tokens_per_s": round(ceiling, 1)}
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
