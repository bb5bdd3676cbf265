"""What constrained decoding costs the step: tokens/s with every row under a JSON schema.

``python -m tools.constrainbench [--json FILE]`` loads the embedded model once and, for
each batch size N (``--batches``, default 1, 8, 32), builds two engines over it with N
rows admitted and prefilled (the same prompts, greedy), one free (``ignore_eos``) and one
with every row under ``tools.constrainlibs.SCHEMA`` (a typical tool-call-shaped schema).
Their decode steps alternate (free, constrained, free, ...) so that both see the same
noise on a shared machine. Reported per N:

* ``tokens_per_s``: each engine's tokens over its timed steps' time, and the ratio
  constrained / free (the issue's goal: at least 0.9). A constrained row that finishes
  its document (STOP) leaves the batch, which lowers its side: ``rows_left`` says how
  many were still running at the end;
* ``mask_us_per_row``: the time in ``engine.sampling.constrain`` (computing the masks and
  applying them) per constrained row per step; ``mask_cpu_us_per_row`` the same in the
  thread's CPU time, and ``tokens_per_cpu_s`` (``cpu_ratio``) the rates per CPU second
  of this process: on a loaded shared machine the wall clock counts others' work too.

And once: ``compile``: the first compile in a new engine (which builds the library's view
of the 49k tokenizer), a new schema's first use after that, a cached schema's, and the
per-sequence copy ``submit`` makes (on the server's event loop), against the median
free decode step at the largest N. The JSON records the load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

import engine.sampling as sampling
from engine import Constraint, ConstraintKind, FinishEvent, GenerationRequest, SamplingParams
from engine.engine import Engine
from engine.model import LoadedModel, load_model
from tools.constrainlibs import SCHEMA
from tools.prompts import load_prompts

SCHEMA_CONSTRAINT = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))


class MaskTimer:
    """Wraps ``sampling.constrain`` (the runner calls it through the module) to add up
    its time and the constrained rows it masked."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.cpu_seconds = 0.0  # this thread's CPU time: what a loaded machine's waits leave out
        self.rows = 0
        self._inner: Callable[..., Mapping[int, Exception]] = sampling.constrain

    def __call__(self, logits: torch.Tensor, matchers: Any,
                 *budget: float) -> Mapping[int, Exception]:
        started, cpu = time.perf_counter(), time.thread_time()
        dead = self._inner(logits, matchers, *budget)
        self.seconds += time.perf_counter() - started
        self.cpu_seconds += time.thread_time() - cpu
        self.rows += sum(m is not None for m in matchers)
        return dead


def ready_engine(loaded: LoadedModel, batch: int, steps: int,
                 constraint: Constraint | None) -> Engine:
    engine = Engine(loaded, max_batch=batch, num_blocks=batch * 8 + 8, block_size=16)
    prompts = load_prompts()
    for i in range(batch):
        prompt = f"{prompts[i % len(prompts)]}\nThe answer as JSON:"
        engine.submit(GenerationRequest(f"b{i}", prompt, steps + 4,
                                        sampling=SamplingParams(ignore_eos=constraint is None),
                                        constraint=constraint))
    while engine.scheduler.prompt_tokens_to_prefill() or engine.scheduler.waiting:
        engine.step()
    return engine


def measure(loaded: LoadedModel, batch: int, steps: int, warmup: int,
            timer: MaskTimer) -> dict[str, Any]:
    engines = {"free": ready_engine(loaded, batch, steps + warmup, None),
               "constrained": ready_engine(loaded, batch, steps + warmup, SCHEMA_CONSTRAINT)}
    spent = {name: 0.0 for name in engines}
    cpu_spent = {name: 0.0 for name in engines}
    tokens = {name: 0 for name in engines}
    step_ms: dict[str, list[float]] = {name: [] for name in engines}
    mask_before = (timer.seconds, timer.rows, timer.cpu_seconds)
    for turn in range(warmup + steps):
        if turn == warmup:
            mask_before = (timer.seconds, timer.rows, timer.cpu_seconds)
        for name in (list(engines) if turn % 2 == 0 else list(reversed(engines))):
            started, cpu = time.perf_counter(), time.process_time()
            events = engines[name].step()
            took = time.perf_counter() - started
            if turn >= warmup:
                spent[name] += took
                cpu_spent[name] += time.process_time() - cpu
                step_ms[name].append(took * 1000)
                tokens[name] += sum(not isinstance(e, FinishEvent) for e in events)
    rate = {name: round(tokens[name] / spent[name], 1) for name in engines}
    cpu_rate = {name: round(tokens[name] / cpu_spent[name], 1) for name in engines}
    rows = timer.rows - mask_before[1]
    mask_s = timer.seconds - mask_before[0]
    mask_cpu_s = timer.cpu_seconds - mask_before[2]
    return {
        "tokens_per_s": rate,
        "ratio": round(rate["constrained"] / rate["free"], 3),
        "tokens_per_cpu_s": cpu_rate,
        "cpu_ratio": round(cpu_rate["constrained"] / cpu_rate["free"], 3),
        "median_step_ms": {n: round(statistics.median(t), 2) for n, t in step_ms.items()},
        "mask_us_per_row": round(mask_s / rows * 1e6, 1) if rows else None,
        "mask_cpu_us_per_row": round(mask_cpu_s / rows * 1e6, 1) if rows else None,
        "rows_left": {n: len(e.scheduler.running) for n, e in engines.items()},
    }


def compile_times(loaded: LoadedModel) -> dict[str, float]:
    engine = Engine(loaded, max_batch=1, num_blocks=16, block_size=16)

    def ms(fn: Callable[[], object]) -> float:
        started = time.perf_counter()
        fn()
        return round((time.perf_counter() - started) * 1000, 2)

    other = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({**SCHEMA, "title": "other"}))
    constraints = engine._intake.constraints
    return {
        "first_compile_with_tokenizer_ms": ms(lambda: engine.compile_constraint(other)),
        "first_use_ms": ms(lambda: engine.compile_constraint(SCHEMA_CONSTRAINT)),
        "cached_ms": ms(lambda: engine.compile_constraint(SCHEMA_CONSTRAINT)),
        "matcher_copy_ms": ms(lambda: constraints.matcher(SCHEMA_CONSTRAINT)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.constrainbench", description=__doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=24, help="timed decode steps each")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch's intra-op threads")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    loaded = load_model(args.model, args.device)
    timer = MaskTimer()
    sampling.constrain = timer  # type: ignore[assignment]
    try:
        compiled = compile_times(loaded)
        batches = {str(n): measure(loaded, n, args.steps, args.warmup, timer)
                   for n in args.batches}
    finally:
        sampling.constrain = timer._inner  # type: ignore[assignment]
    summary = {
        "model": args.model, "device": str(loaded.device),
        "torch_threads": torch.get_num_threads(), "timed_steps": args.steps,
        "schema": SCHEMA, "batches": batches, "compile": compiled,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }
    text = json.dumps(summary, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
